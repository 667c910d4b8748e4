"""Exact sampled-token log-probs, chunked over tokens: upstream's fallback without its per-row loop.

    log p(y_t) = z_t[y_t] - logsumexp(z_t)          d/dz_t = g_t (onehot(y_t) - softmax(z_t))

What it replaces. `verl.utils.torch_functional.logprobs_from_logits` (verl 0.9.1) uses flash-attn's
Triton cross-entropy when flash-attn is installed, torch_npu's on Ascend, and otherwise
`logprobs_from_logits_v2`, which for bf16 logits loops over the rows in Python (one log_softmax per
token: far slower than one batched log_softmax, docs/performance.md).
This file is that fallback's replacement; opd_patches/patches/logprobs_from_logits_v2.py swaps it in (flash-attn and
NPU paths untouched).

Numerics (matching what upstream computes where the actor runs, VERL's FSDP engine under
torch.autocast(bf16) on CUDA):
- fp32 maths for bf16/fp16/fp32 logits (fp64 for fp64): the log-softmax of each chunk is taken with
  `dtype=float32`, exactly what CUDA autocast does to upstream's log_softmax and what flash-attn's
  kernel does; values are returned in fp32 (fp64 for fp64 logits), as both of those return them.
  (Without autocast, e.g. on the CPU platform, upstream's v2 keeps bf16 logits in bf16 and rounds the
  log-probs to bf16; this path is the more precise one there.)
- gradient: computed in fp32 per chunk and written in the logits' dtype, as autocast's cast-back does.
- labels equal to IGNORE_INDEX (-100, flash-attn's default that upstream's GPU path inherits) give
  log-prob 0 and zero gradient; upstream's v2 would fail on them (gather out of range).
- `inplace_backward` (an argument of upstream's logprobs_from_logits, forwarded only to flash-attn)
  has no counterpart here: writing the gradient into the logits' storage is unsafe when another loss
  (entropy, a top-k distillation loss) saved the same logits for its own backward.

Memory. Forward: one (chunk, V) fp32 scratch per chunk; saves only the logits (already alive: the
lm_head output) and the labels. Backward: the (T, V) gradient in the logits' dtype (needed by the
lm_head's backward anyway) plus one (chunk, V) fp32 scratch; no (T, V) fp32 tensor is ever held.
`chunk` changes memory and speed only, never values.

Selection: `opd.fast_logprobs` (opd_patches/config.py) -> `enabled()` in every Ray worker.
Shapes: logits (..., V), labels (...) integer -> log-probs (...).
"""

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from opd_patches import config

IGNORE_INDEX = -100
CHUNK_BYTES = 256 * 2**20  # fp32 scratch per chunk: 441 tokens at V = 151,936


def enabled() -> bool:
    """Whether upstream's fallback is replaced by this path (`opd.fast_logprobs`)."""
    return config.current().fast_logprobs


def default_chunk(vocab: int) -> int:
    """Tokens per chunk so that one (chunk, vocab) fp32 scratch buffer is about CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (4 * max(1, vocab)))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class SampledLogprob(torch.autograd.Function):
    """(N, V) logits, (N,) int64 labels, chunk -> (N,) log-probs; see the module docstring."""

    @staticmethod
    def forward(ctx, logits, labels, chunk):
        compute = _compute_dtype(logits.dtype)
        ignored = labels == IGNORE_INDEX
        safe = labels.masked_fill(ignored, 0)
        out = torch.empty(labels.shape[0], dtype=compute, device=logits.device)
        for a in range(0, labels.shape[0], chunk):
            b = a + chunk
            log_probs = F.log_softmax(logits[a:b], dim=-1, dtype=compute)
            out[a:b] = log_probs.gather(-1, safe[a:b, None])[:, 0]
            del log_probs  # free before the next chunk allocates its own
        out.masked_fill_(ignored, 0.0)
        ctx.save_for_backward(logits, safe, ignored)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, safe, ignored = ctx.saved_tensors
        compute = _compute_dtype(logits.dtype)
        neg_g = grad_out.to(compute).masked_fill(ignored, 0.0).neg_()
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for a in range(0, safe.shape[0], ctx.chunk):
            b = a + ctx.chunk
            p = F.softmax(logits[a:b], dim=-1, dtype=compute)
            p.scatter_add_(-1, safe[a:b, None], p.new_full((p.shape[0], 1), -1.0))  # softmax - onehot
            if p.is_cuda or p.dtype == grad.dtype:  # g (onehot - softmax), cast to the logits' dtype in one pass
                torch.mul(p, neg_g[a:b, None], out=grad[a:b])
            else:  # the CPU's mixed-dtype `out=` path is not vectorised (slower than multiply, then cast)
                grad[a:b] = p.mul_(neg_g[a:b, None])
            del p
        return grad, None, None


def sampled_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """log softmax(logits)[labels] over the last dimension, exactly, chunked over tokens.

    logits (..., V) float; labels (...) integer (IGNORE_INDEX -> 0). Returns (...) in fp32 (fp64 for
    fp64 logits). chunk: tokens per chunk (default: default_chunk(V)).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"sampled_logprobs: logits {tuple(logits.shape)} need labels of shape "
                         f"{tuple(logits.shape[:-1])}, got {tuple(labels.shape)}.")
    if not logits.is_floating_point():
        raise TypeError(f"sampled_logprobs: logits must be floating point, got {logits.dtype}.")
    vocab = logits.shape[-1]
    chunk = int(chunk or default_chunk(vocab))
    if chunk < 1:
        raise ValueError(f"sampled_logprobs: chunk must be >= 1, got {chunk}.")
    out = SampledLogprob.apply(logits.reshape(-1, vocab), labels.reshape(-1).long(), chunk)
    return out.view(labels.shape)
