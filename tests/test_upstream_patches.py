"""Guards for the run-time patches in opd_patches/backends/upstream_patches.py.

If one of these fails after a VERL or torch upgrade, the patched upstream code moved or changed:
re-read it, then adapt or delete the patch. Do not loosen the assertions.
"""

import inspect
import json
import subprocess
import sys
import textwrap

import pytest
import verl.utils.distributed as verl_distributed
from verl.workers.config import RolloutConfig
from verl.workers.config.distillation import DistillationTeacherModelConfig
from verl.workers.rollout import base as rollout_base

import opd_patches  # noqa: F401
from opd_patches.backends.upstream_patches import dedupe_backend


def test_verl_still_builds_the_duplicated_backend_string():
    for fn in (verl_distributed.initialize_global_process_group, verl_distributed.initialize_global_process_group_ray):
        assert 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"' in inspect.getsource(fn), fn.__name__


def test_dedupe_backend():
    assert dedupe_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert dedupe_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert dedupe_backend("gloo") == "gloo"
    assert dedupe_backend(None) is None


# One fresh process for both patches of torch.distributed.init_process_group (a real gloo group each time):
# every case without the patch first, then `upstream_patches.apply()` (it imports VERL), then every case
# with it. A failed init leaves no group behind, so the cases can follow each other. Prints one JSON line
# per case: {"case", "out" (what the case printed), "error" (the exception's text, if any)}.
_INIT_CASES = textwrap.dedent(
    """
    import contextlib, io, json, os, socket, sys, torch, torch.distributed as dist
    store = sys.argv[1]

    def case(name, fn):
        out, error = io.StringIO(), None
        with contextlib.redirect_stdout(out):
            try:
                fn()
            except Exception as exc:  # torch's error, reported to the test
                error = f"{type(exc).__name__}: {exc}"
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
        print(json.dumps({"case": name, "out": out.getvalue(), "error": error}), flush=True)

    def duplicate(tag):
        def fn():
            dist.init_process_group(backend="cpu:gloo,cpu:gloo", init_method=f"file://{store}/{tag}", rank=0,
                                    world_size=1)
            dist.all_reduce(torch.ones(1))
        return fn

    def other_forms():  # upstream's own call forms pass through: positional, and no backend
        dist.init_process_group("gloo", init_method=f"file://{store}/positional", rank=0, world_size=1)
        dist.destroy_process_group()
        dist.init_process_group(init_method=f"file://{store}/default", rank=0, world_size=1)
        dist.all_reduce(torch.ones(1))

    def taken_port(world):  # VERL's env:// rendezvous on a port another socket holds
        def fn():
            held = socket.socket(); held.bind(("127.0.0.1", 0)); held.listen()
            port = str(held.getsockname()[1])
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE=str(world))
            try:
                dist.init_process_group(backend="gloo", world_size=world, rank=0)
                dist.all_reduce(torch.ones(1))
                print("moved" if os.environ["MASTER_PORT"] != port else "same")
            finally:
                held.close()
        return fn

    case("plain duplicate", duplicate("plain"))
    case("plain taken port, 1 rank", taken_port(1))
    from opd_patches.backends import upstream_patches
    upstream_patches.apply()
    case("patched duplicate", duplicate("patched"))
    case("patched other forms", other_forms)
    case("patched taken port, 1 rank", taken_port(1))
    case("patched taken port, 2 ranks", taken_port(2))
    """
)


@pytest.fixture(scope="module")
def init_cases(tmp_path_factory):
    store = tmp_path_factory.mktemp("init_store")
    proc = subprocess.run([sys.executable, "-c", _INIT_CASES, str(store)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {row["case"]: row for row in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.fresh_process
def test_torch_refuses_the_duplicate_and_accepts_it_patched(init_cases):
    """A real single-rank gloo group, with and without the patch."""
    assert "Duplicate device type cpu" in (init_cases["plain duplicate"]["error"] or ""), init_cases
    for name in ("patched duplicate", "patched other forms"):
        assert init_cases[name]["error"] is None, init_cases[name]


@pytest.mark.fresh_process
def test_a_taken_master_port_is_retried_for_one_rank_only(init_cases):
    """VERL picks MASTER_PORT seconds before torch listens on it; another process can take it meanwhile
    (a CI run failed on EADDRINUSE). Single rank: retried on a fresh port; several ranks: torch's error."""
    for name in ("plain taken port, 1 rank", "patched taken port, 2 ranks"):
        row = init_cases[name]
        assert row["error"] and row["error"].startswith("DistNetworkError") and "EADDRINUSE" in row["error"], row
    row = init_cases["patched taken port, 1 rank"]
    assert row["error"] is None and row["out"].split()[-1] == "moved", row
    assert "MASTER_PORT" in row["out"] and "retrying on" in row["out"], row


def _teacher(name):
    return DistillationTeacherModelConfig(key="t", model_path="/m", inference=RolloutConfig(name=name))


def test_upstream_topk_validation_still_rejects_unknown_engines():
    original = DistillationTeacherModelConfig._validate_topk_logprobs.__wrapped__
    with pytest.raises(NotImplementedError, match="does not support inference engine hf"):
        original(_teacher("hf"), use_topk=True, topk=16)


def test_patched_topk_validation_accepts_hf_only():
    _teacher("hf")._validate_topk_logprobs(use_topk=True, topk=16)
    with pytest.raises(ValueError, match="topk must be specified"):
        _teacher("hf")._validate_topk_logprobs(use_topk=True, topk=None)
    with pytest.raises(NotImplementedError):
        _teacher("trtllm")._validate_topk_logprobs(use_topk=True, topk=16)


def test_rollout_class_registry_is_still_the_private_dict():
    assert isinstance(rollout_base._ROLLOUT_REGISTRY, dict) and ("vllm", "async") in rollout_base._ROLLOUT_REGISTRY
    from opd_patches.backends.hf_rollout import HFServerAdapter

    assert rollout_base.get_rollout_class("hf", "async") is HFServerAdapter


def test_topk_logits_processor_still_looks_up_the_wrapped_function_at_call_time():
    """The tail term and the memory-lean mode rely on VERL reading `fsdp_losses.compute_forward_kl_topk`
    from the module on every call (so the wrapper is what runs), with the arguments it forwards."""
    from verl.trainer.distillation import losses as distill_losses
    from verl.trainer.distillation.fsdp import losses as fsdp_losses

    assert "distillation_loss_fn = fsdp_losses.compute_forward_kl_topk" in inspect.getsource(
        distill_losses.compute_topk_loss
    )
    original = fsdp_losses.compute_forward_kl_topk.__wrapped__
    assert list(inspect.signature(original).parameters) == [
        "student_logits", "teacher_topk_log_probs", "teacher_topk_ids", "config", "data_format"
    ]
    # The lean kernel reproduces exactly these semantics (losses/lean_topk.py): change them, re-derive it.
    source = inspect.getsource(original)
    for line in (
        "student_topk_log_probs.clamp_min(loss_config.log_prob_min_clamp)",
        "teacher_topk_log_probs.clamp_min(loss_config.log_prob_min_clamp)",
        "distillation_losses = kl_divergence(log_q=student_topk_log_probs, log_p=teacher_topk_log_probs)",
        "student_mass = student_topk_log_probs.exp().sum(dim=-1)",
    ):
        assert line in source, line


@pytest.mark.parametrize("loss_mode", ["forward_kl_topk", "forward_kl_topk_tail"])
def test_lean_mode_of_the_wrapper_gives_the_originals_outputs(monkeypatch, loss_mode):
    from types import SimpleNamespace

    import torch
    from verl.trainer.distillation.fsdp import losses as fsdp_losses

    from opd_patches.losses import lean_topk

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 11, 50, generator=gen) * 3
    lp, ids = torch.log_softmax(torch.randn(11, 50, generator=gen) * 3, -1).topk(6, -1)
    offsets = torch.tensor([0, 4, 11])
    nested = [torch.nested.nested_tensor_from_jagged(x, offsets) for x in (lp, ids)]
    config = SimpleNamespace(distillation_loss=SimpleNamespace(
        loss_mode=loss_mode, log_prob_min_clamp=-10.0, use_chunked_topk=False))
    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(lean_topk.ENV, mode)
        z = logits.clone().requires_grad_(True)
        out = fsdp_losses.compute_forward_kl_topk(z, *nested, config, "thd")
        sum(out[k].sum() for k in ("distillation_losses", "tail_losses") if k in out).backward()
        results[mode] = (out, z.grad)
    (plain, g0), (lean, g1) = results["0"], results["1"]
    assert set(plain) == set(lean) and ("tail_losses" in lean) == (loss_mode == "forward_kl_topk_tail")
    for key in plain:
        torch.testing.assert_close(lean[key].to(plain[key].dtype), plain[key], rtol=1e-5, atol=1e-6, msg=key)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)


# ---- patch 5: the sampled-token log-prob fallback (losses/sampled_logprob.py) ----------------------


def test_logprobs_fallback_is_still_v2_looked_up_at_call_time():
    """Patch 5 replaces the module attribute `logprobs_from_logits_v2`; that reaches the engine only while
    upstream's `logprobs_from_logits` reads it from torch_functional's globals, after the flash-attn and
    NPU branches, with (logits, labels)."""
    import verl.utils.torch_functional as verl_F

    source = inspect.getsource(verl_F.logprobs_from_logits)
    assert "if _use_flash_ce:" in source and "elif NPU_CROSS_ENTROPY_LOSS_AVAILABLE:" in source
    assert "    else:\n        output = logprobs_from_logits_v2(logits, labels)" in source
    assert verl_F.logprobs_from_logits.__globals__ is vars(verl_F)
    original = verl_F.logprobs_from_logits_v2.__wrapped__
    assert list(inspect.signature(original).parameters) == ["logits", "labels"]
    # The kernel reproduces these semantics (fp32 logsumexp for fp32/fp64, per-row log_softmax otherwise).
    v2 = inspect.getsource(original)
    assert "torch.logsumexp(logit, dim=-1)" in v2 and "F.log_softmax(row_logits, dim=-1)" in v2


def test_every_binding_of_logprobs_from_logits_reaches_the_patch():
    """`from verl.utils.torch_functional import logprobs_from_logits` copies the function object, not v2:
    each importer (the FSDP engine above all) must hold upstream's function, and nothing in verl may
    bind `logprobs_from_logits_v2` itself (that copy would bypass the patch)."""
    from pathlib import Path

    import verl
    import verl.utils.torch_functional as verl_F
    from verl.workers.engine.fsdp import transformer_impl

    assert transformer_impl.logprobs_from_logits is verl_F.logprobs_from_logits
    call = inspect.getsource(transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs)
    assert call.count("log_probs = logprobs_from_logits(") == 2
    root = Path(verl.__file__).parent
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if "logprobs_from_logits_v2" in p.read_text(errors="replace"))
    assert users == ["utils/torch_functional.py"], users
    # The other importers (optional engines: automodel, torchtitan, naive rollout, prefix grouper) import
    # the same function object by name, so they reach the patch too.
    importers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                       if "import logprobs_from_logits" in p.read_text(errors="replace"))
    for rel in importers:
        assert "from verl.utils.torch_functional import logprobs_from_logits\n" in (root / rel).read_text(), rel
    assert "workers/engine/fsdp/transformer_impl.py" in importers


@pytest.mark.parametrize("fast", ["1", "0"])
def test_the_engines_logprobs_call_takes_the_patched_path(monkeypatch, fast):
    """Call the FSDP engine's own binding, as prepare_model_outputs does: on -> the chunked kernel's
    autograd node, off -> upstream's v2. (Where flash-attn is installed, upstream's path wins: skip.)"""
    import torch
    import verl.utils.torch_functional as verl_F
    from verl.workers.engine.fsdp import transformer_impl

    from opd_patches.losses import sampled_logprob

    if verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE or verl_F.NPU_CROSS_ENTROPY_LOSS_AVAILABLE:
        pytest.skip("flash-attn or torch_npu installed: upstream's own kernel runs, the fallback is never hit")
    monkeypatch.setenv(sampled_logprob.ENV, fast)
    logits = torch.randn(7, 50, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (7,))
    out = transformer_impl.logprobs_from_logits(logits=logits, labels=labels, inplace_backward=True)
    nodes = [out.grad_fn] + [fn for fn, _ in out.grad_fn.next_functions if fn is not None]
    taken = [type(fn).__name__ for fn in nodes]  # the kernel's node sits under a view
    assert any("SampledLogprob" in name for name in taken) == (fast == "1"), taken
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
