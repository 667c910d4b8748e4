"""The HF export built from a state's files (opd_patches/ops/state_export.py) equals upstream's own export.

Real VERL on the embedded student (tied embeddings: VERL's drop_tied_target_keys path), FSDP2 on CPU
gloo ranks: each rank trains one AdamW step, then upstream's `FSDPCheckpointManager.save_checkpoint`
saves twice, once with `hf_model` in `save_contents` (upstream's export, gathered to rank 0) and once
without (what opd.background_export leaves to the finish). `write_export` on the second must give the
same files and the same tensors.
"""

import json
import multiprocessing as mp

import pytest
import torch
from safetensors.torch import load_file

from opd_patches.ops import state_export

WITH_HF = ["model", "optimizer", "extra", "hf_model"]
WITHOUT_HF = ["model", "optimizer", "extra"]


def _save_rank(rank, world, store, student, out):
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(student, torch_dtype=torch.float32)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)  # a large step: the export differs from the start
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    tokenizer = AutoTokenizer.from_pretrained(student)
    for name, contents in (("upstream", WITH_HF), ("ours", WITHOUT_HF)):
        config = OmegaConf.create({"save_contents": contents, "load_contents": WITHOUT_HF})
        manager = FSDPCheckpointManager(model, optim, processing_class=tokenizer, checkpoint_config=config)
        manager.save_checkpoint(f"{out}/{name}/actor", global_step=1)
    dist.destroy_process_group()


def _save_both(tmp_path, student, world):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_save_rank, args=(r, world, tmp_path / "store", str(student), str(tmp_path)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * world
    return tmp_path / "upstream" / "actor", tmp_path / "ours" / "actor"


def _weights(hf):
    files = sorted(p.name for p in hf.glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(hf / f))
    return files, tensors


@pytest.mark.fresh_process
def test_export_from_the_state_equals_upstreams_export(tmp_path, embedded):
    """Two ranks: the shards merged in rank order. One rank (the one-GPU case, the local shard is the whole
    tensor): `make bench PHASE=save` checks it at SIZE=cpu in tests/test_bench.py and at 1.5B on the GPU."""
    upstream, ours = _save_both(tmp_path, embedded["student"], 2)
    assert not list((ours / "huggingface").glob("*.safetensors"))  # upstream wrote config + tokenizer only
    written = state_export.write_export(ours)
    files, expected = _weights(upstream / "huggingface")
    got_files, got = _weights(ours / "huggingface")
    assert got_files == files and got.keys() == expected.keys()
    assert "lm_head.weight" not in got  # tied to the embeddings: dropped as upstream drops it
    for key in expected:
        assert got[key].dtype == expected[key].dtype == torch.float32, key
        assert torch.equal(got[key], expected[key]), key
    assert written == {"tensors": len(expected), "dtypes": ["float32"]}
    index = ours / "huggingface" / "model.safetensors.index.json"
    assert index.exists() == (upstream / "huggingface" / index.name).exists()
    initial = _weights(embedded["student"])[1]
    assert any(not torch.equal(got[k], initial[k].float()) for k in got if k in initial)  # the trained weights


def test_a_missing_rank_file_and_an_fsdp1_state_are_named(tmp_path):
    actor = tmp_path / "actor"
    actor.mkdir()
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2}))
    with pytest.raises(state_export.ExportError, match="model_world_size_2_rank_0.pt: missing"):
        state_export.merged_state_dict(actor)
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": 1}))
    with pytest.raises(state_export.ExportError, match="FSDP_version 1"):
        state_export.merged_state_dict(actor)


def test_supported_names_what_keeps_upstreams_export():
    assert state_export.supported("fsdp2", ["Qwen2ForCausalLM"]) is None
    assert "fsdp" in state_export.supported("fsdp", ["Qwen2ForCausalLM"])
    assert "causal LMs" in state_export.supported("fsdp2", ["Qwen2ForTokenClassification"])


def _apply(*overrides, path=None):
    from opd_patches.main import apply_export
    from test_config import compose_recipe

    config = compose_recipe("topk", *overrides, device="gpu")  # cpu.yaml turns it off
    if path is not None:
        config.actor_rollout_ref.model.path = str(path)
    apply_export(config)
    return config.opd.background_export, list(config.actor_rollout_ref.actor.checkpoint.save_contents)


def test_the_launch_moves_hf_model_from_upstreams_save_to_the_finish(embedded, tmp_path):
    assert _apply(path=embedded["student"]) == (True, WITHOUT_HF)
    assert _apply("opd.background_export=false", path=embedded["student"]) == (False, WITH_HF)
    assert _apply("actor_rollout_ref.actor.strategy=fsdp", path=embedded["student"]) == (False, WITH_HF)
    assert _apply("actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra]",
                  path=embedded["student"]) == (False, WITHOUT_HF)  # nothing to export: nothing built
    classifier = tmp_path / "classifier"
    classifier.mkdir()
    (classifier / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForTokenClassification"]}))
    assert _apply(path=classifier) == (False, WITH_HF)


def test_a_bad_value_is_named():
    from opd_patches.main import ConfigError

    with pytest.raises(ConfigError, match="opd.background_export='yes'"):
        _apply("opd.background_export=yes")
