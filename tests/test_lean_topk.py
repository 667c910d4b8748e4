"""The memory-lean top-k KL (opd_patches/losses/lean_topk.py) against its references.

References: upstream's own fsdp `compute_forward_kl_topk` (the unwrapped original, default
non-chunked path, with its `log_prob_min_clamp`) for the truncated sum and the diagnostics, and
tail_kl.tail_term_per_token for the tail; gradients from autograd through those references, in fp32
and in fp64. The lean path must match values and gradients (wrt logits, hidden states, lm_head weight).
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import verl.trainer.distillation.fsdp.losses as fsdp_losses

import opd_patches.registered  # noqa: F401  (installs the wrappers; the reference is the unwrapped original)
from opd_patches.losses import lean_topk as lt
from opd_patches.losses.tail_kl import tail_term_per_token

from flag_runs import run_pair

UPSTREAM = getattr(fsdp_losses.compute_forward_kl_topk, "__wrapped__", fsdp_losses.compute_forward_kl_topk)


def _config(clamp):
    return SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=clamp, use_chunked_topk=False))


def _nested(x):
    offsets = torch.tensor([0, x.shape[0]])
    return torch.nested.nested_tensor_from_jagged(x, offsets)


def reference(logits, ids, t, clamp, with_tail):
    """Upstream's per-token outputs (+ our tail) from (T, V) logits, differentiable."""
    out = UPSTREAM(logits[None], _nested(t), _nested(ids), _config(clamp), "thd")
    out = {k: v[0] for k, v in out.items()}
    if with_tail:
        out["tail_losses"] = tail_term_per_token(logits, ids.long(), t)
    return out


def reference64(logits, ids, t, clamp, with_tail):
    """The same maths written out in the input's dtype (upstream and tail_kl compute in fp32)."""
    s = torch.log_softmax(logits, -1).gather(-1, ids)
    s_c, t_c = (s, t) if clamp is None else (s.clamp_min(clamp), t.clamp_min(clamp))
    out = {"distillation_losses": (t_c.exp() * (t_c - s_c)).sum(-1)}
    if with_tail:
        teacher_tail = torch.log(-torch.expm1(torch.logsumexp(t, -1)))
        student_tail = torch.logsumexp(logits.scatter(-1, ids, float("-inf")), -1) - torch.logsumexp(logits, -1)
        out["tail_losses"] = teacher_tail.exp() * (teacher_tail - student_tail)
    return out


def problem(t_len, v, k, seed, dtype=torch.float32, scale=3.0):
    """Random student logits and a teacher top-k (sorted, from a different random distribution)."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t_len, v, generator=gen) * scale).to(dtype)
    teacher = torch.log_softmax(torch.randn(t_len, v, generator=gen, dtype=torch.float64) * scale, -1)
    lp, ids = teacher.topk(k, dim=-1)
    weights = torch.rand(t_len, generator=gen, dtype=torch.float64)
    return logits, ids, lp.to(dtype if dtype == torch.float64 else torch.float32), weights


def _loss(out, weights, with_tail):
    total = out["distillation_losses"] + (out["tail_losses"] if with_tail else 0)
    return (total * weights.to(total.dtype)).sum()


def compare(logits, ids, t, weights, clamp, with_tail, chunk, rtol, atol):
    ref_in = logits.detach().clone().requires_grad_(True)
    lean_in = logits.detach().clone().requires_grad_(True)
    ref = reference(ref_in, ids, t, clamp, with_tail)
    lean = lt.lean_topk(lean_in, ids, t, clamp=clamp, with_tail=with_tail, chunk=chunk)
    for name in ("distillation_losses", "student_mass", "teacher_mass", "overlap_token_advantage") + (
        ("tail_losses",) if with_tail else ()
    ):
        torch.testing.assert_close(lean[name].to(ref[name].dtype), ref[name], rtol=rtol, atol=atol, msg=name)
    assert torch.equal(lean["overlap_count"], ref["overlap_count"])
    _loss(ref, weights, with_tail).backward()
    _loss(lean, weights, with_tail).backward()
    assert torch.isfinite(lean_in.grad).all()
    torch.testing.assert_close(lean_in.grad, ref_in.grad, rtol=rtol, atol=atol)
    return lean, lean_in.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", [(1, 7, 1), (9, 50, 4), (33, 257, 16)])
@pytest.mark.parametrize("clamp", [None, -10.0, -4.0])
@pytest.mark.parametrize("with_tail", [False, True])
def test_values_and_gradients_match_upstream_fp32(seed, shape, clamp, with_tail):
    t_len, v, k = shape
    logits, ids, t, w = problem(t_len, v, k, seed)
    compare(logits, ids, t, w, clamp, with_tail, chunk=5, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_tail", [False, True])
@pytest.mark.parametrize("clamp", [None, -4.0])
def test_fp64_reference(with_tail, clamp):
    """Against the maths in float64: the lean path computes in fp32 by design, so fp32 rounding apart."""
    logits, ids, t, w = problem(17, 300, 8, seed=5, dtype=torch.float64)
    lean_in = logits.clone().requires_grad_(True)
    lean = lt.lean_topk(lean_in, ids, t, clamp=clamp, with_tail=with_tail, chunk=4)
    _loss(lean, w, with_tail).backward()
    ref_in = logits.clone().requires_grad_(True)
    ref = reference64(ref_in, ids, t, clamp, with_tail)
    _loss(ref, w, with_tail).backward()
    for name in ref:
        torch.testing.assert_close(lean[name].double(), ref[name], rtol=1e-5, atol=1e-6)
    assert lean_in.grad.dtype == torch.float64
    torch.testing.assert_close(lean_in.grad, ref_in.grad, rtol=1e-5, atol=1e-7)


def test_closed_form_matches_issue_formula():
    """dL/dz = m_T q - p_T 1[S], plus (1-m_T)/(1-m_S) q (1[S] - m_S) for the tail (no clamp)."""
    logits, ids, t, _ = problem(6, 40, 5, seed=3, dtype=torch.float64)
    z = logits.clone().requires_grad_(True)
    out = lt.lean_topk(z, ids, t, with_tail=True, chunk=2)
    (out["distillation_losses"] + out["tail_losses"]).sum().backward()
    q = torch.softmax(logits, -1)
    in_s = torch.zeros_like(q).scatter(-1, ids, 1.0)
    p_t = torch.zeros_like(q).scatter(-1, ids, t.exp())
    m_t, m_s = t.exp().sum(-1, keepdim=True), (q * in_s).sum(-1, keepdim=True)
    expected = m_t * q - p_t + (1 - m_t) / (1 - m_s) * q * (in_s - m_s)
    torch.testing.assert_close(z.grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("with_tail", [False, True])
def test_k_equals_v_is_the_exact_kl(with_tail):
    logits, ids, t, w = problem(8, 24, 24, seed=4, dtype=torch.float64)
    z = logits.clone().requires_grad_(True)
    out = lt.lean_topk(z, ids, t, with_tail=with_tail, chunk=3)
    total = out["distillation_losses"] + (out["tail_losses"] if with_tail else 0)
    teacher = torch.zeros_like(logits).scatter(-1, ids, t)
    exact = F.kl_div(torch.log_softmax(logits, -1), teacher, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(total.double(), exact, rtol=1e-5, atol=1e-6)
    (total * w).sum().backward()
    zr = logits.clone().requires_grad_(True)
    (F.kl_div(torch.log_softmax(zr, -1), teacher, log_target=True, reduction="none").sum(-1) * w).sum().backward()
    assert torch.isfinite(z.grad).all()
    torch.testing.assert_close(z.grad, zr.grad, rtol=1e-5, atol=1e-6)


def test_masks_and_all_masked():
    logits, ids, t, _ = problem(12, 60, 4, seed=6)
    mask = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 1], dtype=torch.float32)
    compare(logits, ids, t, mask / mask.sum(), -10.0, True, chunk=5, rtol=1e-5, atol=1e-6)
    z = logits.clone().requires_grad_(True)
    out = lt.lean_topk(z, ids, t, clamp=-10.0, with_tail=True, chunk=5)
    zero = torch.zeros(12)
    loss = ((out["distillation_losses"] + out["tail_losses"]) * zero).sum() / zero.sum().clamp_min(1)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(z.grad).all() and (z.grad == 0).all()


def test_dummy_rows_with_duplicate_ids():
    """The teacher layout's last row is (log-prob 0, id 0) x K: duplicates accumulate like gather's backward."""
    logits, ids, t, w = problem(5, 30, 4, seed=7)
    ids[-1], t[-1] = 0, 0.0
    compare(logits, ids, t, w, -10.0, True, chunk=2, rtol=1e-5, atol=1e-6)


def test_chunk_size_invariance():
    logits, ids, t, w = problem(23, 97, 6, seed=8)
    base, base_grad = compare(logits, ids, t, w, -10.0, True, chunk=23, rtol=1e-5, atol=1e-6)
    for chunk in (1, 4, 7, 1000):
        out, grad = compare(logits, ids, t, w, -10.0, True, chunk=chunk, rtol=1e-5, atol=1e-6)
        for name in base:
            torch.testing.assert_close(out[name], base[name], rtol=0, atol=1e-6)
        torch.testing.assert_close(grad, base_grad, rtol=0, atol=1e-7)


def test_bf16_logits_match_the_autocast_reference():
    """bf16 logits (the actor's lm_head output): upstream under CUDA autocast runs log_softmax in fp32
    and casts the gradient back to bf16; the lean path does the same arithmetic."""
    logits, ids, t, w = problem(16, 128, 8, seed=9, dtype=torch.bfloat16)
    ref_in = logits.float().requires_grad_(True)
    _loss(reference(ref_in, ids, t, -10.0, True), w, True).backward()
    z = logits.clone().requires_grad_(True)
    out = lt.lean_topk(z, ids, t, clamp=-10.0, with_tail=True, chunk=5)
    _loss(out, w, True).backward()
    assert z.grad.dtype == torch.bfloat16 and out["distillation_losses"].dtype == torch.float32
    torch.testing.assert_close(z.grad, ref_in.grad.to(torch.bfloat16), rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("with_tail", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_from_hidden_gradients_wrt_hidden_and_weight(with_tail, dtype):
    gen = torch.Generator().manual_seed(10)
    t_len, h, v, k = 19, 12, 70, 5
    hidden = torch.randn(t_len, h, generator=gen, dtype=dtype)
    weight = torch.randn(v, h, generator=gen, dtype=dtype)
    _, ids, t, w = problem(t_len, v, k, seed=11, dtype=dtype)
    hr, wr = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = (reference if dtype == torch.float32 else reference64)(F.linear(hr, wr), ids, t, -4.0, with_tail)
    _loss(ref, w, with_tail).backward()
    hl, wl = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lean = lt.lean_topk_from_hidden(hl, wl, ids, t, clamp=-4.0, with_tail=with_tail, chunk=4)
    _loss(lean, w, with_tail).backward()
    for name in ref:
        torch.testing.assert_close(lean[name].to(ref[name].dtype), ref[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hl.grad, hr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wl.grad, wr.grad, rtol=1e-5, atol=1e-5)


def test_topk_outputs_matches_upstream_keys_and_shapes():
    logits, ids, t, _ = problem(10, 64, 4, seed=12)
    cfg = _config(-10.0).distillation_loss
    out = lt.topk_outputs(logits[None], ids[None], t[None], cfg, with_tail=False)
    ref = UPSTREAM(logits[None], _nested(t), _nested(ids), _config(-10.0), "thd")
    assert set(out) == set(ref) and all(out[k].shape == ref[k].shape == (1, 10) for k in ref)
    assert "tail_losses" in lt.topk_outputs(logits[None], ids[None], t[None], cfg, with_tail=True)


@pytest.fixture(scope="module")
def lean_run_pair(upstream_paths, topk_tail_skip_off):
    """The real CPU runs of `topk_tail` (tiny models, tests/flag_runs.py) on upstream's paths (the lean path
    and fast log-probs off, stopped by the wall clock after a step or more) and on the default paths (the
    bench's 2-step run), both with the old-log-prob pass on; step 1 is compared."""
    return run_pair(upstream_paths.out, topk_tail_skip_off)


def check_run_pair(runs):
    """Step 1 sees the same rollout and teacher in both runs, so its metrics must agree.

    On the CPU the actor's autocast keeps upstream's log_softmax in bf16 (CUDA autocast runs it in fp32,
    which the lean path matches to fp32 rounding, see the tests above), so the truncated sum and the
    masses agree to bf16 rounding only; the tail term is fp32 on both paths and agrees tightly.
    """
    (off_rows, off_log), (on_rows, on_log) = runs["false"], runs["true"]
    assert "memory-lean top-k kernel" in on_log and "memory-lean top-k kernel" not in off_log
    off, on = off_rows[0]["data"], on_rows[0]["data"]
    tolerances = {"actor/distillation/tail_loss": 1e-4, "actor/distillation/loss": 1e-2, "actor/loss": 1e-2,
                  "actor/distillation/student_mass": 1e-2, "actor/grad_norm": 1e-2}
    missing = [k for k in tolerances if k not in off or k not in on]
    assert not missing, (missing, sorted(off))
    for key, rel in tolerances.items():
        assert on[key] == pytest.approx(off[key], rel=rel), (key, on[key], off[key])


@pytest.mark.slow
def test_end_to_end_lean_matches_upstream_path(lean_run_pair):
    check_run_pair(lean_run_pair)


@pytest.mark.parametrize("with_tail", [False, True])
def test_micro_batch_split_is_bitwise_invariant(with_tail):
    """Per-token losses and logit gradients do not depend on how the tokens are split into calls."""
    gen = torch.Generator().manual_seed(0)
    t_, v, k = 60, 448, 16
    z = torch.randn(t_, v, generator=gen) * 3
    ids = torch.randint(0, v, (t_, k), generator=gen)
    teacher = torch.log_softmax(torch.randn(t_, v, generator=gen), -1).gather(-1, ids)
    weights = torch.rand(t_, generator=gen)

    def run(parts):
        losses, grads = [], []
        for idx in parts:
            leaf = z[idx].clone().requires_grad_()
            out = lt.lean_topk(leaf, ids[idx], teacher[idx], clamp=-10.0, with_tail=with_tail, chunk=7)
            loss = out["distillation_losses"] + (out["tail_losses"] if with_tail else 0)
            (loss * weights[idx]).sum().backward()
            losses.append(loss.detach())
            grads.append(leaf.grad)
        return torch.cat(losses), torch.cat(grads)

    whole = run([slice(0, t_)])
    for parts in ([slice(0, 30), slice(30, t_)], [slice(i, i + 1) for i in range(t_)]):
        got = run(parts)
        assert torch.equal(got[0], whole[0]) and torch.equal(got[1], whole[1])
