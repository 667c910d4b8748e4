"""The chunked exact sampled-token log-prob (opd_patches/losses/sampled_logprob.py) against its references.

References: log_softmax + gather in fp32 and in fp64 of the same logits (values and gradients through
autograd), upstream's `logprobs_from_logits_v2` (the fallback the patch replaces) and, end to end, the
real VERL trainer on the CPU with the patch on and off (tests/flag_runs.py).
"""

import json
import math

import pytest
import torch

from opd_patches.losses import sampled_logprob as sl

from flag_runs import run_pair
from fresh_verl import facts


def _data(shape, vocab, dtype, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=gen)
    weights = torch.randn(shape, generator=gen, dtype=torch.float64)
    return logits, labels, weights


def _reference(logits, labels, weights, ref_dtype):
    """log_softmax + gather in ref_dtype; returns (values, gradient wrt the logits, in ref_dtype)."""
    z = logits.detach().to(ref_dtype).requires_grad_(True)
    values = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (values * weights.to(ref_dtype)).sum().backward()
    return values.detach(), z.grad


def _ours(logits, labels, weights, chunk=None):
    z = logits.detach().clone().requires_grad_(True)
    values = sl.sampled_logprobs(z, labels, chunk=chunk)
    (values * weights.to(values.dtype)).sum().backward()
    return values.detach(), z.grad


# bf16 logits: the values are fp32 maths on the exact bf16 inputs (fp32 rounding); the gradient is
# rounded once to bf16 (relative 2^-8), as autocast's cast-back does upstream.
TOL = {  # (logits dtype, reference dtype) -> (values rtol, atol), (grad rtol, atol)
    (torch.float32, torch.float32): ((1e-6, 1e-5), (1e-6, 1e-6)),
    (torch.float32, torch.float64): ((1e-6, 1e-5), (1e-6, 1e-6)),
    (torch.bfloat16, torch.float32): ((1e-6, 1e-5), (8e-3, 1e-5)),
    (torch.bfloat16, torch.float64): ((1e-6, 1e-5), (8e-3, 1e-5)),
    (torch.float64, torch.float64): ((1e-12, 1e-12), (1e-12, 1e-12)),
}


@pytest.mark.parametrize("dtype,ref_dtype", list(TOL))
@pytest.mark.parametrize("shape", [(37,), (3, 13), (2, 3, 5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_values_and_gradients_match_log_softmax_gather(dtype, ref_dtype, shape, seed):
    logits, labels, weights = _data(shape, 211, dtype, seed)
    values, grad = _ours(logits, labels, weights, chunk=5)
    ref_values, ref_grad = _reference(logits, labels, weights, ref_dtype)
    (vr, va), (gr, ga) = TOL[(dtype, ref_dtype)]
    assert values.shape == shape and values.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(values.to(ref_dtype), ref_values, rtol=vr, atol=va)
    torch.testing.assert_close(grad.to(ref_dtype), ref_grad, rtol=gr, atol=ga)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_chunk_size_changes_nothing(dtype):
    logits, labels, weights = _data((53,), 97, dtype, seed=3)
    base_values, base_grad = _ours(logits, labels, weights, chunk=53)
    for chunk in (1, 4, 7, 52, 1000, None):
        values, grad = _ours(logits, labels, weights, chunk=chunk)
        # Rows are independent: each row's maths is the same whatever the chunk it falls in.
        torch.testing.assert_close(values, base_values, rtol=0, atol=0)
        torch.testing.assert_close(grad, base_grad, rtol=0, atol=0)


def test_closed_form_two_tokens():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64, requires_grad=True)
    values = sl.sampled_logprobs(logits, torch.tensor([0, 1]))
    torch.testing.assert_close(values, torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64))
    values.sum().backward()  # d log p(y) / dz = onehot(y) - softmax(z)
    torch.testing.assert_close(logits.grad, torch.tensor([[0.5, -0.5], [-0.75, 0.75]], dtype=torch.float64))


def test_ignored_labels_give_zero_and_no_gradient():
    """-100 labels (flash-attn's ignore_index, which upstream's GPU path inherits) -> 0, zero gradient."""
    logits, labels, weights = _data((9,), 31, torch.float32, seed=4)
    labels[[2, 7]] = sl.IGNORE_INDEX
    values, grad = _ours(logits, labels, weights, chunk=4)
    assert (values[[2, 7]] == 0).all() and (grad[[2, 7]] == 0).all()
    keep = labels != sl.IGNORE_INDEX
    ref_values, ref_grad = _reference(logits[keep], labels[keep], weights[keep], torch.float64)
    torch.testing.assert_close(values[keep].double(), ref_values, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad[keep].double(), ref_grad, rtol=1e-6, atol=1e-6)


def test_all_ignored_and_empty_inputs_are_finite():
    logits = torch.randn(4, 11, requires_grad=True)
    values = sl.sampled_logprobs(logits, torch.full((4,), sl.IGNORE_INDEX))
    values.sum().backward()
    assert (values == 0).all() and (logits.grad == 0).all()
    empty = torch.randn(0, 11, requires_grad=True)
    out = sl.sampled_logprobs(empty, torch.zeros(0, dtype=torch.long))
    out.sum().backward()
    assert out.shape == (0,) and empty.grad.shape == (0, 11)


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4]], dtype=torch.bfloat16, requires_grad=True)
    values = sl.sampled_logprobs(logits, torch.tensor([1, 2]))
    values.sum().backward()
    assert torch.isfinite(values).all() and torch.isfinite(logits.grad).all()
    z = logits.detach().double()  # 1e4 is not a bf16 number: compare with the values actually held
    expected = torch.tensor([z[0, 1] - z[0, 0], -math.log(3.0)], dtype=torch.float64)
    torch.testing.assert_close(values.double(), expected, rtol=1e-6, atol=1e-5)


def test_no_grad_forward_and_shape_errors():
    logits, labels, _ = _data((2, 6), 40, torch.bfloat16, seed=5)
    with torch.no_grad():  # old_log_prob: forward only
        values = sl.sampled_logprobs(logits, labels)
    ref, _ = _reference(logits, labels, torch.zeros(2, 6), torch.float32)
    torch.testing.assert_close(values, ref, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="need labels of shape"):
        sl.sampled_logprobs(logits, labels[:, :3])
    with pytest.raises(ValueError, match="chunk must be"):
        sl.sampled_logprobs(logits, labels, chunk=-1)


def test_default_chunk_bounds_the_fp32_scratch():
    assert sl.default_chunk(151_936) * 151_936 * 4 <= sl.CHUNK_BYTES
    assert sl.default_chunk(10**12) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_agrees_with_upstreams_fallback(dtype):
    """Upstream's v2 (the unpatched original): fp32 logits -> same fp32 maths; bf16 logits without
    autocast -> v2's CPU log_softmax works and rounds in bf16, so they agree to a few bf16 ulps (ours is
    the closer one to fp64); its bf16 gradient likewise."""
    from verl.utils import torch_functional as verl_F

    original = getattr(verl_F.logprobs_from_logits_v2, "__wrapped__", verl_F.logprobs_from_logits_v2)
    logits, labels, weights = _data((4, 29), 301, dtype, seed=6)
    values, grad = _ours(logits, labels, weights)
    z = logits.detach().clone().requires_grad_(True)
    upstream = original(z, labels)
    (upstream * weights.to(upstream.dtype)).sum().backward()
    ref_values, ref_grad = _reference(logits, labels, weights, torch.float64)
    if dtype == torch.float32:
        torch.testing.assert_close(values, upstream, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(grad, z.grad, rtol=1e-6, atol=1e-6)
    else:
        assert upstream.dtype == torch.bfloat16
        torch.testing.assert_close(values, upstream.float(), rtol=1e-2, atol=1e-5)  # v2 rounds in steps
        torch.testing.assert_close(grad.float(), z.grad.float(), rtol=0, atol=2**-7 * weights.abs().max().item())
        assert (values.double() - ref_values).abs().max() < (upstream.double() - ref_values).abs().max()
        assert (grad.double() - ref_grad).abs().max() <= (z.grad.double() - ref_grad).abs().max()


def test_recipe_key_reaches_the_workers(tmp_path):
    """opd.fast_logprobs -> the workers' config (OPD_CONFIG in Ray's runtime env) -> enabled() there."""
    from composed import compose_recipe
    from conftest import worker_config_of
    from opd_patches import config

    assert worker_config_of(tmp_path, fast_logprobs=False).fast_logprobs is False
    assert worker_config_of(tmp_path).fast_logprobs is True is compose_recipe("k1").opd.fast_logprobs
    with pytest.raises(config.ConfigError, match="opd.fast_logprobs"):
        worker_config_of(tmp_path, fast_logprobs="yes")
    assert sl.enabled()
    with config.override(fast_logprobs=False):
        assert not sl.enabled()


# ---- end to end: the real VERL trainer (2 CPU steps, tiny models) with the patch on and off ----------


@pytest.fixture(scope="module")
def logprob_run_pair(topk_tail_skip_off, upstream_paths):
    # topk_tail, both with the old-log-prob pass on: its rollout_corr/* metrics are the reference below.
    return run_pair(upstream_paths.out, topk_tail_skip_off)


@pytest.mark.slow
def test_end_to_end_patched_path_matches_upstream(logprob_run_pair):
    """The CPU has no flash-attn, so VERL's actor takes the fallback: the run with the key on must say it
    ran the chunked kernel, the run with it off must not. Step 1 sees the same rollout in both runs, and
    VERL logs how far the actor's old_log_prob is from the rollout's own (fp32) log-probs of the same
    tokens (rollout_corr/*): an independent reference. The actor's CPU autocast makes upstream's v2
    round log-probs to bf16 (measured here: |training - rollout| log-ppl 5e-3); the kernel's fp32 must
    sit much closer. The runs' losses and gradient norms (the top-k loss reads the logits, not these
    log-probs; the off run also has the lean path off) are test_lean_topk.py's comparison of the same
    pair; the gradient through the kernel is checked against autograd above."""
    (off_rows, off_log), (on_rows, on_log) = logprob_run_pair["false"], logprob_run_pair["true"]
    marker = "sampled-token log-probs: chunked exact kernel"
    assert marker in on_log and marker not in off_log
    off, on = off_rows[0]["data"], on_rows[0]["data"]
    assert on["response_length/mean"] == off["response_length/mean"]  # same rollout: same step-1 batch
    assert on["rollout_corr/rollout_log_ppl"] == pytest.approx(off["rollout_corr/rollout_log_ppl"], abs=1e-5)
    assert on["rollout_corr/log_ppl_abs_diff"] < 1e-3
    assert on["rollout_corr/log_ppl_abs_diff"] <= off["rollout_corr/log_ppl_abs_diff"]


@pytest.mark.fresh_process
def test_a_fresh_process_gets_the_patch_through_the_env_var():
    """What VERL_USE_EXTERNAL_MODULES=opd_patches.registered does in every Ray worker (tests/fresh_verl.py)."""
    assert facts("registered")["logprobs_patched"] is True


def test_microbench_runs_at_a_tiny_size(tmp_path, capsys):
    from tools.bench import logprob

    out = tmp_path / "logprob.json"
    assert logprob.main(["--tokens", "96", "--vocab", "257", "--repeats", "1", "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert {"upstream_v2", "patched", "naive"} <= set(rows)
    assert rows["patched"]["max_abs_err"] < 1e-5 and all(r["time_s"] > 0 for r in rows.values())
    assert "patched" in capsys.readouterr().out
