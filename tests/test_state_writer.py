"""Background state writes (opd_patches/ops/state_writer.py, the run-time patch
opd_patches/patches/fsdp_save_checkpoint.py) through upstream's real
FSDPCheckpointManager on a tiny FSDP2 Qwen2 (one gloo rank): the save returns before the files exist, the
files hold the state as it was at the call (training changes it right after), upstream's load_checkpoint
restores it, and a failed write leaves the state without a receipt."""

import inspect
import threading

import pytest
import torch
from dist_group import single_rank_gloo

from opd_patches import config
from opd_patches.ops import finish, receipts, state_writer
from opd_patches.patches import fsdp_save_checkpoint, registry

V = 64


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    with single_rank_gloo(tmp_path_factory):
        yield


def _trained(seed: int):
    """A tiny Qwen2 under FSDP2 with AdamW state after one step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    model = Qwen2ForCausalLM(config)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optim)
    return model, optim


def _step(model, optim):
    ids = torch.randint(0, V, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    optim.step()
    optim.zero_grad()


def _manager(model, optim):
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    return FSDPCheckpointManager(model, optim)


def _local(sd):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in sd.items()}


class Other(torch.Tensor):
    """A Tensor subclass the snapshot does not know (as FSDP1's ShardedTensor)."""


class _GatedWriter(state_writer._Writer):
    """The real writer, held at the gate until the test opens it (the disk 'slow')."""

    def __init__(self, fail: BaseException | None = None):
        self.gate = threading.Event()

        def save(obj, path, *a, **k):
            self.gate.wait(60)
            if fail is not None:
                raise fail
            torch.save(obj, path, *a, **k)

        super().__init__(save=save)


def test_upstream_save_still_writes_through_its_module_torch():
    """Patch 8's premise: upstream's save_checkpoint writes its three state files with `torch.save(obj, path)`
    read from its module's globals. If this fails, upstream changed how it writes: revisit the patch."""
    from verl.utils.checkpoint import fsdp_checkpoint_manager as module

    source = inspect.getsource(module.FSDPCheckpointManager.save_checkpoint)
    for call in ("torch.save(model_state_dict, model_path)", "torch.save(optimizer_state_dict, optim_path)",
                 "torch.save(extra_state_dict, extra_path)"):
        assert call in source, call
    assert module.torch is torch


def test_save_returns_before_the_write_and_keeps_the_state_of_the_call(process_group, tmp_path):
    from verl.utils.checkpoint import fsdp_checkpoint_manager as module

    model, optim = _trained(0)
    manager = _manager(model, optim)
    at_save = _local(model.state_dict())
    first = optim.param_groups[0]["params"][0]
    moments = {k: v.full_tensor().clone() for k, v in optim.state[first].items() if hasattr(v, "full_tensor")}

    writer = _GatedWriter()
    state = tmp_path / "global_step_1" / "actor"
    with fsdp_save_checkpoint.deferred_saves(module, writer):
        manager.save_checkpoint(str(state), global_step=1)
    assert module.torch is torch  # restored on the way out
    names = [f"{part}_world_size_1_rank_0.pt" for part in ("model", "optim", "extra_state")]
    assert all((state / (n + state_writer.WRITING)).exists() and not (state / n).exists() for n in names)
    with pytest.raises(TimeoutError, match="still being written"):
        receipts.wait_for_writes(state.parent, timeout_s=0.3, poll_s=0.05)

    _step(model, optim)  # training goes on and changes weights and moments in place
    assert any(not torch.equal(at_save[k], v) for k, v in _local(model.state_dict()).items())
    writer.gate.set()
    receipts.wait_for_writes(state.parent, timeout_s=60)
    writer.drain()
    assert all((state / n).exists() for n in names)
    assert not list(state.rglob("*" + state_writer.PARTIAL))

    # upstream's own load restores the state as it was when save_checkpoint was called
    fresh, fresh_optim = _trained(1)
    _manager(fresh, fresh_optim).load_checkpoint(str(state))
    loaded = _local(fresh.state_dict())
    assert loaded.keys() == at_save.keys()
    for k in at_save:
        torch.testing.assert_close(loaded[k], at_save[k], rtol=0, atol=0)
    restored = fresh_optim.state[fresh_optim.param_groups[0]["params"][0]]
    assert moments.keys() == {"exp_avg", "exp_avg_sq"}
    for k, v in moments.items():
        torch.testing.assert_close(restored[k].full_tensor(), v, rtol=0, atol=0)


def test_patch_routes_upstream_saves_to_the_writer(process_group, tmp_path, monkeypatch):
    """patches/fsdp_save_checkpoint.py as a run's worker applies it: same files as the original's, written by the thread."""
    from verl.utils.checkpoint import fsdp_checkpoint_manager as module

    model, optim = _trained(2)
    _manager(model, optim).save_checkpoint(str(tmp_path / "sync"), global_step=1)
    original = module.FSDPCheckpointManager.save_checkpoint
    seen = []
    monkeypatch.setattr(state_writer._WRITER, "_save", lambda obj, path, *a, **k: (seen.append(path),
                                                                                   torch.save(obj, path, *a, **k)))
    record = None
    try:
        assert fsdp_save_checkpoint.apply() is None  # outside a run: upstream's synchronous save
        with config.override(background_state_write=False, run_dir=str(tmp_path)):
            assert fsdp_save_checkpoint.apply() is None  # a run with the key off
        with config.override(run_dir=str(tmp_path)):  # a run's worker, opd.background_state_write at its default
            record = fsdp_save_checkpoint.apply()
            assert fsdp_save_checkpoint.apply() is record  # idempotent: one record, one wrapper
        assert module.FSDPCheckpointManager.save_checkpoint is record.replacement
        assert record.replacement.__wrapped__ is original
        _manager(model, optim).save_checkpoint(str(tmp_path / "async"), global_step=1)
        state_writer._WRITER.drain()
    finally:
        if record is not None:
            registry.revert(record)  # the original back, the record forgotten
    assert module.FSDPCheckpointManager.save_checkpoint is original
    assert len(seen) == 3 and all(p.endswith(state_writer.PARTIAL) for p in seen)
    for name in ("model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt"):
        a = torch.load(tmp_path / "sync" / name, weights_only=False)
        b = torch.load(tmp_path / "async" / name, weights_only=False)
        flat_a, _ = torch.utils._pytree.tree_flatten(a)
        flat_b, _ = torch.utils._pytree.tree_flatten(b)
        assert len(flat_a) == len(flat_b)
        for x, y in zip(flat_a, flat_b):
            if isinstance(x, torch.Tensor):
                assert type(x) is type(y)
                torch.testing.assert_close(x, y, rtol=0, atol=0)
            else:
                assert x == y


def test_a_failed_write_leaves_no_receipt(process_group, tmp_path):
    from verl.utils.checkpoint import fsdp_checkpoint_manager as module

    model, optim = _trained(3)
    writer = _GatedWriter(fail=OSError(28, "No space left on device"))
    state = tmp_path / "global_step_2"
    with fsdp_save_checkpoint.deferred_saves(module, writer):
        _manager(model, optim).save_checkpoint(str(state / "actor"), global_step=2)
    writer.gate.set()
    writer.drain()
    out = finish.finish(state, 2, validate=False)
    assert "No space left on device" in out["error"] and "_world_size_1_rank_0.pt of" in out["error"]
    assert not (state / receipts.NAME).exists()
    assert receipts.problem(state) is not None
    assert not list(state.rglob("*" + state_writer.WRITING)) and not list(state.rglob("*" + state_writer.PARTIAL))


def test_file_objects_and_unknown_tensor_types_are_written_at_once(tmp_path):
    proxy = state_writer._TorchDeferredSave(_GatedWriter())  # the gate is never opened
    with open(tmp_path / "x.pt", "wb") as f:
        proxy.save({"a": torch.ones(2)}, f)
    assert torch.equal(torch.load(tmp_path / "x.pt")["a"], torch.ones(2))

    proxy.save({"state": [torch.zeros(1), torch.ones(3).as_subclass(Other)]}, tmp_path / "y.pt")
    assert not (tmp_path / ("y.pt" + state_writer.WRITING)).exists()
    assert torch.equal(torch.load(tmp_path / "y.pt", weights_only=False)["state"][1], torch.ones(3))
    assert proxy.float32 is torch.float32 and proxy.distributed is torch.distributed


def test_snapshot_copies_tensors_and_leaves():
    t = torch.arange(4.0)
    groups = [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]
    snap = state_writer.snapshot({"w": t, "param_groups": groups, "step": 3, "none": None})
    t.add_(1)
    groups[0]["lr"] = 9.0
    assert torch.equal(snap["w"], torch.arange(4.0)) and snap["param_groups"][0]["lr"] == 0.1
    assert snap["param_groups"][0]["betas"] == (0.9, 0.99) and snap["step"] == 3 and snap["none"] is None


def test_a_failed_snapshot_leaves_no_marker(tmp_path, monkeypatch):
    """The error reaches upstream's save; no `.writing` marker is left for the finish to wait on."""
    def broken(obj):
        raise RuntimeError("pinned allocation failed")

    monkeypatch.setattr(state_writer, "snapshot", broken)
    with pytest.raises(RuntimeError, match="pinned allocation failed"):
        _GatedWriter().submit({"a": torch.ones(1)}, str(tmp_path / "m.pt"), (), {})
    assert not list(tmp_path.iterdir())
