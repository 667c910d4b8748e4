"""The fused Triton kernels of the lean top-k KL (losses/lean_topk_triton.py), on CPU through Triton's
interpreter, against (a) LeanTopK's torch path and (b) the full-softmax autograd reference of
tests/test_lean_topk.py (and upstream's function for the diagnostics).

Triton reads TRITON_INTERPRET=1 when it is imported, and a pytest process has imported it long before
(verl imports torch._dynamo, which imports triton). So in such a process the kernel tests are skipped
and `test_kernels_in_triton_interpreter` runs this file again in a fresh process with the variable set.
Small BLOCK_V (patched) so that every V here spans several blocks and none is a multiple of it.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (requirements/cpu.txt pins it for these tests)")

from opd_patches import config  # noqa: E402
from opd_patches.losses import lean_topk as lt  # noqa: E402
from opd_patches.losses import lean_topk_triton as ltt  # noqa: E402
from opd_patches.losses.tail_kl import TAIL_EPS  # noqa: E402
from test_lean_topk import _loss, problem, reference, reference64  # noqa: E402

BLOCK = 128
INTERPRETED = ltt.interpreted()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 process of test_kernels_in_triton_interpreter")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(ltt, "BLOCK_V", BLOCK)


@pytest.mark.fresh_process
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter process")
def test_kernels_in_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop(config.ENV, None)  # the defaults (opd.lean_topk_kernel=auto), whatever this process runs under
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # Only this test skips itself there: every kernel test ran in the interpreter.
    assert re.search(r"\d+ passed, 1 skipped", proc.stdout), proc.stdout[-2000:]


def run(path, logits, ids, t, weights, clamp, with_tail, monkeypatch):
    """Outputs and logit gradient of lean_topk with opd.lean_topk_kernel=path."""
    with config.override(lean_topk_kernel=path):
        z = logits.detach().clone().requires_grad_(True)
        out = lt.lean_topk(z, ids, t, clamp=clamp, with_tail=with_tail, chunk=9)
        _loss(out, weights, with_tail).backward()
    return out, z.grad


def hard_rows(logits, ids, t):
    """Row 0: teacher tail below TAIL_EPS (its top-k renormalised); last row: the dummy layout (id 0 x K,
    log-prob 0: duplicate ids); row 1: duplicate ids with real log-probs."""
    t, ids = t.clone(), ids.clone()
    t[0] = torch.log_softmax(t[0], -1)
    ids[-1], t[-1] = 0, 0.0
    if ids.shape[1] > 1:
        ids[1, 1] = ids[1, 0]
    return ids, t


@needs_interpreter
@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clamp", [None, -10.0])
@pytest.mark.parametrize("with_tail", [False, True])
def test_kernel_path_matches_torch_path_and_reference(k, dtype, clamp, with_tail, monkeypatch):
    # k=4, 16: rows > chunk (9), no multiple of it; V spans 3-4 blocks of BLOCK, none a multiple of it
    t_len, v = {1: (7, 300), 4: (11, 389), 16: (13, 421)}[k]
    logits, ids, t, w = problem(t_len, v, k, seed=k, dtype=dtype)
    ids, t = hard_rows(logits, ids, t)
    lse = torch.logsumexp(logits.float(), -1, keepdim=True)
    if clamp is not None:  # the clamp's pass-through mask is exercised
        assert (logits.float().gather(-1, ids) - lse < clamp).any()

    calls = []
    monkeypatch.setattr(ltt, "lean_topk_triton_grad", _spy(ltt.lean_topk_triton_grad, calls))
    fast, fast_grad = run("triton", logits, ids, t, w, clamp, with_tail, monkeypatch)
    assert calls, "the kernel path was not taken"
    slow, slow_grad = run("torch", logits, ids, t, w, clamp, with_tail, monkeypatch)
    assert fast_grad.dtype == dtype and torch.isfinite(fast_grad).all()

    # (a) the torch path: every output, overlap counts only where logits have no ties (fp32).
    for name in set(slow) - {"overlap_count", "overlap_token_advantage"}:
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-5, atol=1e-6, msg=name)
    if dtype == torch.float32:
        assert torch.equal(fast["overlap_count"], slow["overlap_count"])
        torch.testing.assert_close(fast["overlap_token_advantage"], slow["overlap_token_advantage"])
    else:  # the documented tie convention: fewer than K logits strictly greater than z[id_j]
        z = logits.float()
        above = (z[:, None, :] > z.gather(-1, ids)[:, :, None]).sum(-1)
        assert torch.equal(fast["overlap_count"], (above < k).sum(-1))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(fast_grad, slow_grad, **tol)

    # (b) the full-softmax autograd reference, in fp32 (bf16 logits: its gradient cast to bf16). With the
    # tail, rows whose teacher tail is below TAIL_EPS (rows 0 and -1) have a zero tail term on the lean
    # paths (checked above against the torch path) where the plain reference takes log(0 or tiny).
    rows = (-torch.expm1(torch.logsumexp(t, -1)) > TAIL_EPS) if with_tail else torch.ones(t_len, dtype=torch.bool)
    assert rows.sum() >= t_len - 2
    ref_in = logits.float().requires_grad_(True)
    ref = reference64(ref_in, ids, t, clamp, with_tail)
    _loss(ref, w * rows, with_tail).backward()
    assert fast["distillation_losses"].dtype == torch.float32
    for name in ref:
        torch.testing.assert_close(fast[name][rows], ref[name][rows], rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(fast_grad[rows], ref_in.grad[rows].to(dtype), **tol)
    # Upstream's own diagnostics (masses) on the same inputs.
    up = reference(logits.float(), ids, t, clamp, with_tail)
    for name in ("student_mass", "teacher_mass"):
        torch.testing.assert_close(fast[name], up[name], rtol=1e-5, atol=1e-6, msg=name)


def _spy(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapped


@needs_interpreter
@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_against_torch(k, dtype):
    """lse, lse_out, above of the forward kernel, by definition; odd block sizes and V."""
    logits, ids, _, _ = problem(5, 333, k, seed=20 + k, dtype=dtype)
    ids[2, -1] = ids[2, 0]
    for block_v in (32, 128, 512):
        lse, lse_out, above = ltt.lean_topk_triton_parts(logits, ids, with_tail=True, block_v=block_v, num_warps=4)
        z = logits.float()
        torch.testing.assert_close(lse, torch.logsumexp(z, -1), rtol=1e-6, atol=1e-6)
        want_out = torch.logsumexp(z.scatter(-1, ids, float("-inf")), -1)
        torch.testing.assert_close(lse_out, want_out, rtol=1e-6, atol=1e-6)
        assert torch.equal(above.long(), (z[:, None, :] > z.gather(-1, ids)[:, :, None]).sum(-1))
        assert ltt.lean_topk_triton_parts(logits, ids, with_tail=False, block_v=block_v)[1] is None


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_kernel_formula(dtype):
    """grad = coef q - ct 1[not in S] exp(z - lse_out) - sum_j wg_j 1[= id_j], as _chunk_grad (duplicates add)."""
    logits, ids, _, _ = problem(9, 700, 16, seed=30, dtype=dtype)
    ids[3, 5:9] = ids[3, 0]
    gen = torch.Generator().manual_seed(31)
    lse, lse_out, _ = ltt.lean_topk_triton_parts(logits, ids, with_tail=True)
    coef, ct, wg = torch.rand(9, generator=gen), torch.rand(9, generator=gen), torch.rand(9, 16, generator=gen)
    got = ltt.lean_topk_triton_grad(logits, ids, lse, coef + ct, wg, ct, lse_out, block_v=64)
    want = lt._chunk_grad(logits, ids, lse, wg, torch.ones(9), ct, torch.ones(9), lse_out)
    want = want + (coef - wg.sum(-1))[:, None] * torch.exp(logits.float() - lse[:, None])  # coef = g_trunc M
    assert got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(got, want.to(dtype), **tol)
    plain = ltt.lean_topk_triton_grad(logits, ids, lse, coef, wg, block_v=64)
    want = lt._chunk_grad(logits, ids, lse, wg, torch.ones(9)) + (coef - wg.sum(-1))[:, None] * torch.exp(
        logits.float() - lse[:, None])
    torch.testing.assert_close(plain, want.to(dtype), **tol)


@needs_interpreter
@pytest.mark.parametrize("with_tail", [False, True])
def test_ids_covering_the_vocabulary(with_tail, monkeypatch):
    """V = K: rows whose ids are a permutation of V (lse_out = -inf, no tail gradient; the loss is the exact
    KL) next to one row with a duplicate id (not covering); the kernel path equals the torch path."""
    monkeypatch.setattr(ltt, "BLOCK_V", 8)
    v = k = 16
    logits, _, _, w = problem(6, v, 1, seed=40)
    gen = torch.Generator().manual_seed(41)
    ids = torch.stack([torch.randperm(v, generator=gen) for _ in range(6)])
    t = torch.log_softmax(torch.randn(6, v, generator=gen), -1).gather(-1, ids)
    ids[5, 3] = ids[5, 4]
    _, lse_out, above = ltt.lean_topk_triton_parts(logits, ids, with_tail=True)
    assert torch.isneginf(lse_out[:5]).all() and torch.isfinite(lse_out[5]) and (above < k).all()
    fast, fast_grad = run("triton", logits, ids, t, w, None, with_tail, monkeypatch)
    slow, slow_grad = run("torch", logits, ids, t, w, None, with_tail, monkeypatch)
    for name in slow:
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-5, atol=1e-6, msg=name)
    assert torch.isfinite(fast_grad).all()
    torch.testing.assert_close(fast_grad, slow_grad, rtol=1e-5, atol=1e-6)
    exact = (t.exp() * (t - torch.log_softmax(logits, -1).gather(-1, ids))).sum(-1)
    torch.testing.assert_close(fast["distillation_losses"][:5], exact[:5], rtol=1e-5, atol=1e-6)


@needs_interpreter
def test_fp64_logits_against_fp64_maths(monkeypatch):
    """fp64 logits: fp32 maths inside the kernels (as the torch path), the gradient returned in fp64."""
    logits, ids, t, w = problem(13, 300, 8, seed=5, dtype=torch.float64)
    fast, grad = run("triton", logits, ids, t, w, -4.0, True, monkeypatch)
    ref_in = logits.clone().requires_grad_(True)
    ref = reference64(ref_in, ids, t, -4.0, True)
    _loss(ref, w, True).backward()
    for name in ref:
        torch.testing.assert_close(fast[name].double(), ref[name], rtol=1e-5, atol=1e-6)
    assert grad.dtype == torch.float64
    torch.testing.assert_close(grad, ref_in.grad, rtol=1e-5, atol=1e-7)


def test_kernel_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(ltt, "interpreted", lambda: True)
    assert lt.kernel_choice() == "auto" and lt._use_triton(cpu)  # the interpreter counts as available
    with config.override(lean_topk_kernel="torch"):
        assert not lt._use_triton(cpu)
    with pytest.raises(config.ConfigError, match="opd.lean_topk_kernel='cuda'.*auto, triton, torch"):
        with config.override(lean_topk_kernel="cuda"):
            pass
    monkeypatch.setattr(ltt, "interpreted", lambda: False)
    assert not lt._use_triton(cpu)  # auto on a CPU without the interpreter: the torch path
    with config.override(lean_topk_kernel="triton"):
        with pytest.raises(RuntimeError, match="opd.lean_topk_kernel=triton.*cannot run on cpu"):
            lt._use_triton(cpu)
    monkeypatch.setattr(ltt, "triton", None)
    assert not ltt.available(torch.device("cuda"))


def test_recipe_key_reaches_the_workers(tmp_path):
    """opd.lean_topk_kernel -> the workers' config (OPD_CONFIG in Ray's runtime env); a bad value names the key."""
    from composed import compose_recipe
    from conftest import worker_config_of

    assert worker_config_of(tmp_path, lean_topk_kernel="torch").lean_topk_kernel == "torch"
    assert worker_config_of(tmp_path, lean_topk_kernel="triton").lean_topk_kernel == "triton"
    assert worker_config_of(tmp_path).lean_topk_kernel == "auto" == compose_recipe("topk").opd.lean_topk_kernel
    with pytest.raises(config.ConfigError, match="opd.lean_topk_kernel"):
        worker_config_of(tmp_path, lean_topk_kernel="cuda")
