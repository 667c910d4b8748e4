"""The HF export of a save built from its state files, off the trainer's path (`opd.background_export`).

Upstream's `FSDPCheckpointManager.save_checkpoint` with `hf_model` in `checkpoint.save_contents` gathers
the full weights to rank 0 and `save_pretrained`s them while training waits (7.1 GB at 1.5B; the export
here cuts the trainer's wait at a save by more than half, docs/bench/history.md). With `opd.background_export: true` opd_patches.main takes `hf_model` out of the
actor's `save_contents` (upstream still writes `huggingface/` with the config, tokenizer and generation
config) and the save's finish (finish.py, a CPU subprocess beside training) calls `write_export`:

- it waits for nothing itself: the finish calls it after the state files are on disk (state_writer.py);
- it reads every rank's `model_world_size_W_rank_R.pt` (FSDP2: DTensors on a 1-D mesh; each key's local
  shards concatenated along their `Shard(d)` dim in rank order, a `Replicate` key taken from rank 0),
  memory-mapped, in the dtype the state holds (fp32: what upstream's export writes);
- it writes the weights the way upstream does: an empty model of the saved config
  (`from_config(..., torch_dtype=bfloat16)` under `init_empty_weights`), VERL's `drop_tied_target_keys`,
  then `save_pretrained(huggingface/, state_dict=...)`, so that the folder holds the same files.

Only the finish's receipt makes the state complete, so a crash while exporting leaves a state that is
never resumed from or counted (receipts.py). tests/test_state_export.py compares the result with
upstream's own export of the same model.
"""

import contextlib
import json
import logging
from pathlib import Path

MODEL_FILE = "model_world_size_{world}_rank_{rank}.pt"


class ExportError(RuntimeError):
    pass


def supported(fsdp_strategy: str, architectures) -> str | None:
    """None if `write_export` can build this run's export, else why not (the run keeps upstream's export).
    architectures None: not readable before the launch (a hub id); write_export checks the saved config."""
    if fsdp_strategy != "fsdp2":
        return f"actor strategy {fsdp_strategy} (the export is built from FSDP2 shards only)"
    return None if architectures is None else _not_causal_lm(architectures)


def _not_causal_lm(architectures) -> str | None:
    arch = (list(architectures or []) or [""])[0]
    return None if arch.endswith("ForCausalLM") else f"architecture {arch or 'unknown'} (the export is built for causal LMs only)"


@contextlib.contextmanager
def _quiet(logger: str):
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def merged_state_dict(actor: Path) -> dict:
    """The full weights of `actor/` (a state's actor folder) from every rank's model file, host tensors."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    meta = json.loads((actor / "fsdp_config.json").read_text())
    world, version = int(meta["world_size"]), int(meta.get("FSDP_version", 2))
    if version != 2:
        raise ExportError(f"{actor}/fsdp_config.json: FSDP_version {version}; only FSDP2 shards are merged here")
    ranks = []
    for rank in range(world):
        path = actor / MODEL_FILE.format(world=world, rank=rank)
        if not path.is_file():
            raise ExportError(f"{path}: missing (the state has {world} ranks)")
        with _quiet("torch.distributed.device_mesh"):  # "unpickled before the PGs were created": no PG is needed
            ranks.append(torch.load(path, map_location="cpu", weights_only=False, mmap=True))
    merged = {}
    for key, first in ranks[0].items():
        if not isinstance(first, DTensor):
            merged[key] = first
            continue
        placements = first.placements
        if len(placements) != 1:
            raise ExportError(f"{key}: a {len(placements)}-D device mesh (HSDP); only 1-D FSDP2 meshes are merged")
        locals_ = [r[key]._local_tensor for r in ranks]
        place = placements[0]
        if isinstance(place, Replicate):
            merged[key] = locals_[0]
        elif isinstance(place, Shard):
            merged[key] = locals_[0] if world == 1 else torch.cat(locals_, dim=place.dim)
        else:
            raise ExportError(f"{key}: placement {place} is not merged here")
        if tuple(merged[key].shape) != tuple(first.shape):
            raise ExportError(f"{key}: merged shape {tuple(merged[key].shape)} != the DTensor's {tuple(first.shape)}")
    return merged


def write_export(actor: Path) -> dict:
    """Write the weights into `actor/huggingface` (config and tokenizer already there); what was written."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from verl.utils.transformers_compat import drop_tied_target_keys

    actor = Path(actor)
    hf = actor / "huggingface"
    if not (hf / "config.json").is_file():
        raise ExportError(f"{hf}/config.json: missing (upstream writes it with every save)")
    state_dict = merged_state_dict(actor)
    config = AutoConfig.from_pretrained(hf)
    reason = _not_causal_lm(getattr(config, "architectures", None))
    if reason:
        raise ExportError(f"{hf}: {reason}")
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    if (hf / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(hf)
    drop_tied_target_keys(state_dict, model, config)
    written = {"tensors": len(state_dict),
               "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in state_dict.values()})}
    model.save_pretrained(hf, state_dict=state_dict)  # transformers 5 empties state_dict as it writes
    return written
