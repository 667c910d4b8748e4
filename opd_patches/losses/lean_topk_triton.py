"""Fused Triton kernels of the memory-lean exact top-k KL (lean_topk.py): the O(T*V) parts only.

One program per token row streams the row's logits in BLOCK_V blocks (any float dtype, fp32 maths):
- forward reads each logit once and returns, per row, `lse` = logsumexp over V (online max/sum),
  `lse_out` = logsumexp over V minus S (S = that row's teacher ids; -inf where S covers V; only with
  the tail) and `above` (T, K) int32 = how many logits are strictly greater than z[id_j];
- backward reads each logit once more and writes the gradient once, in the logits' dtype:
      grad_i = coef q_i - ct 1[i not in S] exp(z_i - lse_out) - sum_j wg_j 1[i = id_j],   q = exp(z - lse)
  with coef = g_trunc M + g_tail tail_coef, ct = g_tail tail_coef, wg = g_trunc wa (lean_topk.py's
  notation), the same as lean_topk._chunk_grad (duplicate ids accumulate).
Everything O(T*K) stays in torch (lean_topk.py). KP = K rounded up to a power of two (padding id -1).
`above` is a [BLOCK_V, KP] compare of each block with z[ids]; membership i in S (forward, tail only) is
KP 1-D compares of the column indices with each id, made only in blocks that hold an id. The
backward writes every column as if outside S, then rewrites the K columns of S (no per-column compare).

Under TRITON_INTERPRET=1 the kernels run on CPU tensors through Triton's interpreter (the tests). Triton
reads that variable when its own library and these kernels are wrapped, at import: it must be set before
the process imports triton (torch._dynamo, which verl imports, imports it). V is a constexpr (one
compile per vocabulary size): the interpreter of triton 3.6 cannot loop to a run-time bound under
numpy >= 2.4.
"""

from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings without triton

import torch

try:  # optional: without triton lean_topk.py takes its torch path
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

# The fastest forward, with and without the tail, of the block sizes and warp counts tried at 15,600 x
# 151,936 bf16, K = 16; the backward, near a copy of the logits, is the same for all of them. The forward is
# bound by the [BLOCK_V, KP] `above` compare.
BLOCK_V = 2048
NUM_WARPS = 4


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return triton is not None and type(_forward_kernel).__name__ == "InterpretedFunction"


def available(device) -> bool:
    """Whether the kernels can run for tensors on `device`: triton importable and a CUDA device, or any
    device in the interpreter."""
    return triton is not None and (torch.device(device).type == "cuda" or interpreted())


@_jit
def _forward_kernel(z_ptr, z_stride, ids_ptr, lse_ptr, lse_out_ptr, above_ptr, K, V: tl.constexpr,
                    KP: tl.constexpr, BLOCK_V: tl.constexpr, WITH_TAIL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    kk = tl.arange(0, KP)
    ids = tl.load(ids_ptr + row * K + kk, mask=kk < K, other=-1).to(tl.int32)
    # Padding slots get +inf, so no logit is "above" them.
    zid = tl.load(z_row + ids, mask=kk < K, other=float("inf")).to(tl.float32)
    above = tl.zeros([KP], dtype=tl.int32)
    m, s = float("-inf"), 0.0
    m_out, s_out = float("-inf"), 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        above += tl.sum((z[:, None] > zid[None, :]).to(tl.int32), axis=0)
        # Online logsumexp; the shift is 0 while the running max is -inf (exp(-inf - -inf) is nan).
        m_new = tl.maximum(m, tl.max(z, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        m = m_new
        if WITH_TAIL:
            zo = z
            # Most blocks hold none of the K ids. Where one does, one 1-D compare per id (scalar loads, L1
            # hits): a [BLOCK_V, KP] compare reduced over KP makes the tail forward several times slower.
            if tl.sum(((ids >= start) & (ids < start + BLOCK_V)).to(tl.int32), axis=0) > 0:
                for j in tl.static_range(KP):
                    idj = tl.load(ids_ptr + row * K + j, mask=j < K, other=-1)
                    zo = tl.where(cols == idj, float("-inf"), zo)
            mo_new = tl.maximum(m_out, tl.max(zo, axis=0))
            shift_o = tl.where(mo_new == float("-inf"), 0.0, mo_new)
            s_out = s_out * tl.exp(m_out - shift_o) + tl.sum(tl.exp(zo - shift_o), axis=0)
            m_out = mo_new
    tl.store(lse_ptr + row, m + tl.log(s))
    tl.store(above_ptr + row * K + kk, above, mask=kk < K)
    if WITH_TAIL:
        covered = s_out == 0.0  # S covers V: -inf (log of a safe 1 keeps the interpreter free of warnings)
        tl.store(lse_out_ptr + row, tl.where(covered, float("-inf"), m_out + tl.log(tl.where(covered, 1.0, s_out))))


@_jit
def _grad_kernel(z_ptr, z_stride, g_ptr, g_stride, ids_ptr, wg_ptr, lse_ptr, coef_ptr, ct_ptr, lse_out_ptr,
                 K, V: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr, WITH_TAIL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row, g_row = z_ptr + row * z_stride, g_ptr + row * g_stride
    kk = tl.arange(0, KP)
    ids = tl.load(ids_ptr + row * K + kk, mask=kk < K, other=-1).to(tl.int32)
    wg = tl.load(wg_ptr + row * K + kk, mask=kk < K, other=0.0)
    lse, coef = tl.load(lse_ptr + row), tl.load(coef_ptr + row)
    if WITH_TAIL:
        ct, lse_out = tl.load(ct_ptr + row), tl.load(lse_out_ptr + row)
    # Pass 1, every column as if outside S: coef q_i - ct exp(z_i - lse_out) (no per-column id compare).
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(z_row + cols, mask=cols < V, other=0.0).to(tl.float32)
        g = coef * tl.exp(z - lse)
        if WITH_TAIL:
            g -= ct * tl.exp(z - lse_out)
        tl.store(g_row + cols, g.to(g_ptr.dtype.element_ty), mask=cols < V)
    # Pass 2 overwrites the K columns of S with coef q_i - sum_j wg_j 1[i = id_j], computed whole in fp32
    # (duplicate ids sum their wg and store the same value). The barrier orders these stores after pass
    # 1's, which other threads of the program may have made to the same addresses.
    tl.debug_barrier()
    zid = tl.load(z_row + ids, mask=kk < K, other=0.0).to(tl.float32)
    wsum = tl.sum(tl.where(ids[:, None] == ids[None, :], wg[None, :], 0.0), axis=1)
    tl.store(g_row + ids, (coef * tl.exp(zid - lse) - wsum).to(g_ptr.dtype.element_ty), mask=kk < K)


def _launch_args(logits, ids, block_v, num_warps):
    if logits.dim() != 2 or ids.dim() != 2 or ids.shape[0] != logits.shape[0]:
        raise ValueError(f"lean top-k kernels take logits (T, V) and ids (T, K), got {tuple(logits.shape)} "
                         f"and {tuple(ids.shape)}")
    k = ids.shape[1]
    kp = max(2, 1 << (k - 1).bit_length())  # tl.arange needs a power of two
    return k, kp, block_v or BLOCK_V, num_warps or NUM_WARPS


def lean_topk_triton_parts(logits, ids, *, with_tail, block_v=None, num_warps=None):
    """(lse (T,) fp32, lse_out (T,) fp32 or None, above (T, K) int32) of logits (T, V) (any float dtype,
    unit column stride) and ids (T, K). lse_out is -inf where the row's ids cover V."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ids = ids.long().contiguous()
    k, kp, block_v, num_warps = _launch_args(logits, ids, block_v, num_warps)
    n, v = logits.shape
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse_out = torch.empty(n, dtype=torch.float32, device=logits.device) if with_tail else lse
    above = torch.empty((n, k), dtype=torch.int32, device=logits.device)
    if n:
        _forward_kernel[(n,)](logits, logits.stride(0), ids, lse, lse_out, above, k, v,
                              KP=kp, BLOCK_V=block_v, WITH_TAIL=with_tail, num_warps=num_warps)
    return lse, (lse_out if with_tail else None), above


def lean_topk_triton_grad(logits, ids, lse, coef, wg, ct=None, lse_out=None, *, block_v=None, num_warps=None):
    """dLoss/dlogits (T, V) in the logits' dtype: coef q - ct 1[not in S] exp(z - lse_out) - sum_j wg_j 1[= id_j].

    lse, coef, ct, lse_out (T,) fp32 (ct and lse_out None without the tail term; lse_out must be finite
    where ct != 0), wg (T, K) fp32."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ids = ids.long().contiguous()
    k, kp, block_v, num_warps = _launch_args(logits, ids, block_v, num_warps)
    n, v = logits.shape
    with_tail = ct is not None
    grad = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    lse, coef, wg = (x.float().contiguous() for x in (lse, coef, wg))
    ct, lse_out = (ct.float().contiguous(), lse_out.float().contiguous()) if with_tail else (coef, lse)
    if n:
        _grad_kernel[(n,)](logits, logits.stride(0), grad, grad.stride(0), ids, wg, lse, coef, ct, lse_out, k, v,
                           KP=kp, BLOCK_V=block_v, WITH_TAIL=with_tail, num_warps=num_warps)
    return grad
