"""Bench phase `save`: what a state save makes training wait for, upstream's write against the background one.

    python -m tools.bench --phase save [--workdir DIR]        (make bench PHASE=save)

The size's model in fp32 under FSDP2 on one device (VERL's actor keeps fp32 weights), AdamW after one
step (two moments: the recipes' state), saved with upstream's `FSDPCheckpointManager.save_checkpoint`
(model + optimizer + extra: 21.3 GB at the `full` size) into `--workdir`, each state deleted after its row:
- `save/upstream`: the call as upstream writes it (torch.save from the device): what training waits without the background write;
- `save/background`: the same call under `fsdp_save_checkpoint.deferred_saves` (opd.background_state_write, what the
  workers run): `time_s` = the call (training's wait), `written_s` = from the call to the last file written;
- `save/background_pinned`: the same with page-locked snapshots (state_writer.PINNED), twice: `first_s`
  pays the pinning, `time_s` is the second call (the caching host allocator reuses the blocks).
- `save/background_with_hf_export`: the call with `hf_model` added to its contents (upstream's HF export
  inside the save: the trainer's wait without opd.background_export); `export/built_by_finish`: the
  export built from the written files by `state_export.write_export` (what the background finish runs
  with opd.background_export), `equal_to_upstream`: its tensors hash equal to upstream's export.
The ratio column is each row's wait against `save/upstream`. After `save/background` the model takes
one more optimizer step and upstream's `load_checkpoint` restores the saved files: `restored_exact` says
every weight and moment equals the state at the call (the snapshot is what was saved).
"""

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tools.bench.measure import GIB, row
from tools.bench.sizes import qwen2_config
from opd_patches.ops import state_export, state_writer
from opd_patches.patches import fsdp_save_checkpoint


def _process_group(device: str, workdir: Path) -> None:
    if dist.is_initialized():
        return
    store = Path(tempfile.mkdtemp(dir=workdir)) / "store"
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1)


def _model(size, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen2_config(size)).float()
    model.config.architectures = ["Qwen2ForCausalLM"]  # as from_pretrained sets it: upstream's export reads it
    fully_shard(model, mesh=init_device_mesh(device, (1,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6)
    return model, optim


def _step(model, optim, device, vocab):
    ids = torch.randint(0, vocab, (1, 64), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def _host_state(model, optim) -> dict:
    """Every weight and moment as a full host tensor (the reference for `restored_exact`)."""
    out = {f"w/{k}": v.full_tensor().cpu().clone() for k, v in model.state_dict().items()}  # never a view
    params = [q for group in optim.param_groups for q in group["params"]]
    for i, param in enumerate(params):  # by parameter: a load rebuilds optim.state in another order
        for k, v in optim.state[param].items():
            if hasattr(v, "full_tensor"):
                out[f"m/{i}/{k}"] = v.full_tensor().cpu().clone()
    return out


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_phase(size, args) -> dict:
    from verl.utils.checkpoint import fsdp_checkpoint_manager as module
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    device = size.device
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    _process_group(device, workdir)
    model, optim = _model(size, device)
    vocab = model.config.vocab_size
    _step(model, optim, device, vocab)
    manager = FSDPCheckpointManager(model, optim)
    rows, notes = [], []

    def timed_save(name, deferred, pinned=False):
        state = workdir / f"bench_save_{name}"
        shutil.rmtree(state, ignore_errors=True)
        writer = state_writer._Writer()
        state_writer.PINNED = pinned
        _sync(device)
        start = time.perf_counter()
        if deferred:
            with fsdp_save_checkpoint.deferred_saves(module, writer):
                manager.save_checkpoint(str(state), global_step=1)
        else:
            manager.save_checkpoint(str(state), global_step=1)
        _sync(device)
        wait = time.perf_counter() - start
        writer.drain()
        written = time.perf_counter() - start
        state_writer.PINNED = False
        return state, wait, written

    state, upstream_s, _ = timed_save("upstream", deferred=False)
    gb = _bytes(state) / 1e9
    shutil.rmtree(state)
    print(f"[bench] save/upstream: {upstream_s:.1f} s for {gb:.1f} GB", flush=True)

    at_save = _host_state(model, optim)
    state, wait, written = timed_save("background", deferred=True)
    print(f"[bench] save/background: training waited {wait:.1f} s, written after {written:.1f} s", flush=True)
    _step(model, optim, device, vocab)  # training goes on; then restore the saved state through upstream's load
    manager.load_checkpoint(str(state), del_local_after_load=False)
    restored = _host_state(model, optim)
    exact = restored.keys() == at_save.keys() and all(torch.equal(restored[k], at_save[k]) for k in at_save)
    del restored, at_save
    shutil.rmtree(state)
    rows.append(_row("save/upstream", upstream_s, upstream_s, gb, written_s=upstream_s))
    rows.append(_row("save/background", wait, upstream_s, gb, written_s=written, restored_exact=exact))

    if device == "cuda":
        state, first, _ = timed_save("pinned", deferred=True, pinned=True)
        shutil.rmtree(state)
        state, wait, written = timed_save("pinned", deferred=True, pinned=True)
        shutil.rmtree(state)
        rows.append(_row("save/background_pinned", wait, upstream_s, gb, written_s=written, first_s=first))
    # The HF export: inside upstream's save (hf_model in save_contents, what the trainer waited for
    # before opd.background_export) against built from the written files by the finish (state_export.py).
    manager = FSDPCheckpointManager(model, optim, checkpoint_config=_contents("model", "optimizer", "extra", "hf_model"))
    state, with_export, _ = timed_save("with_export", deferred=True, pinned=device == "cuda")
    reference = _export_digest(state / "huggingface")
    export_gb = _bytes(state / "huggingface") / 1e9
    shutil.rmtree(state)
    manager = FSDPCheckpointManager(model, optim, checkpoint_config=_contents("model", "optimizer", "extra"))
    state, _, _ = timed_save("finish_export", deferred=True, pinned=device == "cuda")
    start = time.perf_counter()
    state_export.write_export(state)
    built_s = time.perf_counter() - start
    equal = _export_digest(state / "huggingface") == reference
    shutil.rmtree(state)
    rows.append(_row("save/background_with_hf_export", with_export, upstream_s, gb, export_gb=export_gb))
    rows.append(_row("export/built_by_finish", built_s, upstream_s, gb, export_gb=export_gb, equal_to_upstream=equal))
    notes.append(f"save/background_with_hf_export: upstream's save with hf_model (the trainer's wait before "
                 f"opd.background_export); export/built_by_finish: state_export.write_export from the written files "
                 f"(the background finish's time, not waited for); same tensors as upstream's export: {equal}")
    notes.append(f"state of {gb:.1f} GB (model + optimizer + extra, fp32 under FSDP2, one rank) into {workdir}; "
                 f"device peak {torch.cuda.max_memory_allocated() / GIB:.1f} GiB" if device == "cuda" else
                 f"state of {gb:.3f} GB into {workdir}")
    notes.append("restored_exact: upstream's load_checkpoint of the background save gives back every weight and "
                 f"moment of the call: {exact}")
    return {"size": size.name, "rows": rows, "notes": notes, "pid": os.getpid()}


def _contents(*names):
    from omegaconf import OmegaConf

    return OmegaConf.create({"save_contents": list(names), "load_contents": ["model", "optimizer", "extra"]})


def _export_digest(hf: Path) -> dict:
    """{file: {tensor: (dtype, shape, sha256)}} of an export's safetensors."""
    import hashlib

    from safetensors.torch import load_file

    out = {}
    for f in sorted(hf.glob("*.safetensors")):
        out[f.name] = {k: (str(t.dtype), tuple(t.shape), hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest())
                       for k, t in load_file(f).items()}
    return out


def _row(name, wait_s, upstream_s, gb, **extra) -> dict:
    """A bench row (measure.row): the wait against upstream's write; no tokens, no device peak."""
    return row(name, {"time_s": wait_s, "peak_gib": None}, {"time_s": upstream_s, "peak_gib": None}, 0,
               state_gb=gb, **extra)
