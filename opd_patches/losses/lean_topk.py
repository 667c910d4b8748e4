"""Memory-lean exact top-k forward KL: loss and closed-form gradient chunk by chunk over tokens.

Same maths as upstream's `forward_kl_topk` (verl/trainer/distillation/fsdp/losses.py, default
non-chunked path) and our `forward_kl_topk_tail` (tail_kl.py), including upstream's clamp:

    s_j = z_j - logsumexp(z)  (fp32),  t_j = teacher log-prob,  j in S = the teacher's top-k ids
    c = distillation_loss.log_prob_min_clamp (None: no clamp);  s~ = max(s, c),  t~ = max(t, c)
    truncated = sum_j exp(t~_j) (t~_j - s~_j)                       (upstream's distillation_losses)
    tail      = (1 - m_T) (log(1 - m_T) - log(1 - m_S))  as tail_kl.tail_term_per_token (no clamp)

Gradient with respect to the logits, q = softmax(z), w_j = exp(t~_j) 1[s_j >= c] (the clamp's
pass-through mask, torch's `clamp_min` convention), M = sum_j w_j:
    d truncated / dz_i = M q_i - sum_j w_j 1[i = j]
    d tail / dz_i      = (1 - m_T) (q_i - 1[i not in S] r_i),  r = softmax of z over the tokens outside S
                       = (1 - m_T)/(1 - m_S) q_i (1[i in S] - m_S)   (the issue's form; r avoids 1/(1-m_S))
The tail gradient is zero where upstream's reference gives zero: teacher tail below TAIL_EPS, or the
student tail log-mass below its floor. Duplicate ids in S (the teacher's dummy last row) accumulate,
as autograd's gather backward does.

Memory (T tokens, V vocabulary, bf16 logits as the actor's autocast lm_head produces them):
- upstream default: log_softmax under CUDA autocast runs in fp32 and saves its (T, V) fp32 output
  (4V bytes/token) for backward; the backward makes a (T, V) fp32 gather-gradient and a (T, V) fp32
  softmax-gradient before casting to bf16: about 8-12 V bytes/token at the peak (1.2-1.8 MB/token at
  V = 151,936), on top of the bf16 logits (2V).
- upstream `use_chunked_topk`: streams the forward, but each chunk's autograd keeps its fp32 copy
  (logsumexp saves its input), so it still holds 4V bytes/token, and rounds s to bf16.
- `LeanTopK` (logits in, used through the VERL hook): saves only the bf16 logits the lm_head already
  produced (2V/token; nothing else keeps them in a distillation-only update) plus O(K) per token;
  backward writes the bf16 gradient (2V/token, needed by lm_head's backward anyway) chunk by chunk,
  with two (chunk, V) fp32 scratch buffers. Peak about 4V bytes/token + 8 V chunk bytes.
- `LeanTopKFromHidden` (hidden + lm_head weight in): the (T, V) logits never exist; forward and
  backward recompute each chunk's logits from the (T, H) hidden states, and produce grad_hidden and
  grad_weight (fp32 accumulator, V x H). Peak: O(chunk x V) + V x H. Wiring it into VERL needs the
  model forward to stop at the hidden states (as upstream's `use_fused_kernels` patch does), so it is
  measured by `make bench` but not hooked in.

Numerics: fp32 throughout per chunk (matches upstream's default path to fp32 rounding); the gradient is
returned in the input's dtype (as autocast's cast-back does upstream). Chunk size changes memory only.

Kernel path (`LeanTopK` only; `LeanTopKFromHidden` stays on torch): `opd.lean_topk_kernel` = auto
(lean_topk_triton's fused kernels where they can run, i.e. CUDA, else torch) | triton | torch.
The forward kernel returns lse, lse_out and per id the count of logits strictly greater than z[id_j]
over the whole (T, V) at once (O(T) outputs, no chunk loop); `_token_terms` computes every O(T*K)
quantity for both paths; the backward kernel writes the gradient of `_chunk_grad`'s formula once.
Tie convention of the overlap diagnostics (`overlap_count`, `overlap_token_advantage`; not in the
loss): on the kernel path a teacher id counts as in the student's top-k when fewer than K logits are
strictly greater than its logit; torch.topk breaks ties arbitrarily, so the paths agree where there
are no ties. The kernel path needs no scratch beyond O(T*K).
Selection: `opd.lean_topk` (opd_patches/config.py) -> `enabled()` in every Ray worker; the hook is
opd_patches/patches/compute_forward_kl_topk.py.
Shapes: logits (T, V) or hidden (T, H) + weight (V, H); teacher ids/log-probs (T, K); outputs (T,).
"""

import math

import torch
import torch.nn.functional as F

from opd_patches import config
from opd_patches.losses import lean_topk_triton
from opd_patches.losses.tail_kl import _LOG_FLOOR, TAIL_EPS, log1mexp

LOSS_MODES = ("forward_kl_topk", "forward_kl_topk_tail")
DEFAULT_CHUNK = 2048  # tokens per chunk: (2048, 151936) fp32 is 1.2 GiB of scratch per buffer
_LOG_TAIL_EPS = math.log(TAIL_EPS)
KERNEL_CHOICES = config.LEAN_TOPK_KERNELS


def enabled() -> bool:
    """Whether the VERL hook routes top-k losses through the lean path (`opd.lean_topk`)."""
    return config.current().lean_topk


def kernel_choice() -> str:
    """The O(T*V) implementation of LeanTopK: `opd.lean_topk_kernel`, one of KERNEL_CHOICES."""
    return config.current().lean_topk_kernel


def _use_triton(device) -> bool:
    choice = kernel_choice()
    if choice == "torch":
        return False
    ok = lean_topk_triton.available(device)
    if choice == "triton" and not ok:
        raise RuntimeError(
            f"opd.lean_topk_kernel=triton, but the Triton kernels cannot run on {device}: they need triton "
            "installed and a CUDA device (or TRITON_INTERPRET=1, the CPU interpreter). Set opd.lean_topk_kernel=auto "
            "or torch.")
    return ok


def _chunk_forward(z, ids, t, clamp, with_tail):
    """Per-token values and backward coefficients of one chunk. z (c, V) fp32 scratch (overwritten)."""
    lse = torch.logsumexp(z, dim=-1)
    s = z.gather(-1, ids) - lse[:, None]
    student_top = z.topk(ids.shape[-1], dim=-1).indices  # overlap diagnostic only (topk(z) == topk(s))
    overlap = (ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(dim=-1)
    lse_out = None
    if with_tail:
        z.scatter_(-1, ids, float("-inf"))
        lse_out = torch.logsumexp(z, dim=-1)  # -inf where S covers the vocabulary
    return _token_terms(s, t, lse, lse_out, overlap, clamp)


def _token_terms(s, t, lse, lse_out, overlap, clamp):
    """Everything O(T*K), shared by the torch and the Triton paths: s (T, K) student log-probs of the ids,
    t (T, K) teacher log-probs, lse (T,), lse_out (T,) (None without the tail), overlap (T, K) bool."""
    s_c, t_c = (s, t) if clamp is None else (s.clamp_min(clamp), t.clamp_min(clamp))
    w = t_c.exp()
    token_kl = w * (t_c - s_c)
    count = overlap.sum(dim=-1)
    adv = (-token_kl * overlap).sum(-1) / count.clamp_min(1)
    out = {
        "truncated": token_kl.sum(-1),
        "student_mass": s.exp().sum(-1),
        "teacher_mass": t.exp().sum(-1),
        "overlap_count": count,
        "overlap_token_advantage": torch.where(count > 0, adv, torch.zeros_like(adv)),
        "lse": lse,
        "wa": w if clamp is None else w * (s >= clamp),
    }
    if lse_out is not None:
        student_tail = lse_out - lse
        teacher_tail = log1mexp(torch.logsumexp(t, dim=-1))
        has = teacher_tail > _LOG_TAIL_EPS
        tt = torch.where(has, teacher_tail, torch.zeros_like(teacher_tail))
        st = torch.where(has, student_tail.clamp(min=_LOG_FLOOR), torch.zeros_like(student_tail))
        out["tail"] = torch.where(has, tt.exp() * (tt - st), torch.zeros_like(tt))
        live = has & (student_tail >= _LOG_FLOOR)  # the floor's clamp passes no gradient below it
        out["tail_coef"] = torch.where(live, tt.exp(), torch.zeros_like(tt))
        out["lse_out"] = torch.where(live, lse_out, lse)  # harmless where unused (keeps exp finite)
    return out


def _chunk_grad(chunk, ids, lse, wa, g_trunc, g_tail=None, tail_coef=None, lse_out=None):
    """dLoss/dz of one chunk, fp32 (c, V). chunk: the logits (c, V) in any float dtype (read, not written);
    bf16 - fp32 promotes to fp32 inside the subtraction, so no separate fp32 copy is made."""
    q = torch.sub(chunk, lse[:, None]).float().exp_()  # .float(): a no-op for bf16/fp32 chunks
    coef = g_trunc * wa.sum(-1)
    if g_tail is not None:
        ct = g_tail * tail_coef
        q.mul_((coef + ct)[:, None])
        # r = softmax over the tokens outside S.
        r = torch.sub(chunk, lse_out[:, None]).float().scatter_(-1, ids, float("-inf")).exp_()
        q.addcmul_(r, ct[:, None], value=-1.0)
        del r
    else:
        q.mul_(coef[:, None])
    return q.scatter_add_(-1, ids, -(g_trunc[:, None] * wa))


_STATS = ("student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage")


def _forward_all(n, device, chunk, logits_of, ids, t, clamp, with_tail):
    """Run _chunk_forward over chunks; returns (per-token outputs, saved coefficients)."""
    k = ids.shape[-1]
    trunc = torch.empty(n, dtype=torch.float32, device=device)
    tail = torch.zeros(n, dtype=torch.float32, device=device)
    stats = {name: torch.empty(n, dtype=torch.float32, device=device) for name in _STATS}
    stats["overlap_count"] = torch.empty(n, dtype=torch.long, device=device)
    lse = torch.empty(n, dtype=torch.float32, device=device)
    wa = torch.empty((n, k), dtype=torch.float32, device=device)
    tail_coef = torch.zeros(n, dtype=torch.float32, device=device) if with_tail else None
    lse_out = torch.empty(n, dtype=torch.float32, device=device) if with_tail else None
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        o = _chunk_forward(logits_of(a, b), ids[a:b], t[a:b], clamp, with_tail)
        trunc[a:b], lse[a:b], wa[a:b] = o["truncated"], o["lse"], o["wa"]
        for name in _STATS:
            stats[name][a:b] = o[name]
        if with_tail:
            tail[a:b], tail_coef[a:b], lse_out[a:b] = o["tail"], o["tail_coef"], o["lse_out"]
    return trunc, tail, stats, (lse, wa, tail_coef, lse_out)


def _forward_triton(logits, ids, t, clamp, with_tail):
    """_forward_all's outputs with the O(T*V) part (lse, lse_out, overlap) from the fused forward kernel."""
    lse, lse_out, above = lean_topk_triton.lean_topk_triton_parts(logits, ids, with_tail=with_tail)
    s = logits.gather(-1, ids).float() - lse[:, None]
    # Tie convention: id_j counts as in the student's top-k when fewer than K logits are strictly greater.
    o = _token_terms(s, t, lse, lse_out, above < ids.shape[-1], clamp)
    tail = o["tail"] if with_tail else torch.zeros_like(o["truncated"])
    saved = (lse, o["wa"], o.get("tail_coef"), o.get("lse_out"))
    return o["truncated"], tail, {name: o[name] for name in _STATS}, saved


def _prepare(ids, t, chunk):
    if chunk is None or chunk <= 0:
        raise ValueError(f"lean top-k chunk size must be a positive number of tokens, got {chunk}")
    return ids.long(), t.float()


class LeanTopK(torch.autograd.Function):
    """(logits (T, V), ids (T, K), teacher log-probs (T, K)) -> truncated (T,), tail (T,), stats...

    Only truncated and tail are differentiable (with respect to logits); the stats are diagnostics.
    """

    @staticmethod
    def forward(ctx, logits, ids, t, clamp, with_tail, chunk):
        ids, t = _prepare(ids, t, chunk)
        ctx.triton = _use_triton(logits.device)
        with torch.autocast(logits.device.type, enabled=False), torch.no_grad():
            if ctx.triton:
                trunc, tail, stats, saved = _forward_triton(logits, ids, t, clamp, with_tail)
            else:
                trunc, tail, stats, saved = _forward_all(
                    logits.shape[0], logits.device, chunk,
                    lambda a, b: logits[a:b].to(torch.float32, copy=True), ids, t, clamp, with_tail,
                )
        ctx.save_for_backward(logits, ids, *[x for x in saved if x is not None])
        ctx.with_tail, ctx.chunk = with_tail, chunk
        ctx.mark_non_differentiable(*stats.values())
        return trunc, tail, *stats.values()

    @staticmethod
    def backward(ctx, g_trunc, g_tail, *_):
        logits, ids, lse, wa, *tail_saved = ctx.saved_tensors
        tail_coef, lse_out = tail_saved if ctx.with_tail else (None, None)
        n = logits.shape[0]
        g_trunc = torch.zeros(n, device=logits.device) if g_trunc is None else g_trunc.float()
        use_tail = ctx.with_tail and g_tail is not None
        with torch.autocast(logits.device.type, enabled=False), torch.no_grad():
            if ctx.triton:  # the same coefficients as _chunk_grad, the O(T*V) part in one kernel
                coef, wg = g_trunc * wa.sum(-1), g_trunc[:, None] * wa
                if use_tail:
                    ct = g_tail.float() * tail_coef
                    grad = lean_topk_triton.lean_topk_triton_grad(logits, ids, lse, coef + ct, wg, ct, lse_out)
                else:
                    grad = lean_topk_triton.lean_topk_triton_grad(logits, ids, lse, coef, wg)
                return grad, None, None, None, None, None
            grad = torch.empty_like(logits)  # allocated here only: the kernel path makes its own
            for a in range(0, n, ctx.chunk):
                b = min(a + ctx.chunk, n)
                extra = (g_tail[a:b].float(), tail_coef[a:b], lse_out[a:b]) if use_tail else ()
                grad[a:b].copy_(_chunk_grad(logits[a:b], ids[a:b], lse[a:b], wa[a:b], g_trunc[a:b], *extra))
        return grad, None, None, None, None, None


class LeanTopKFromHidden(torch.autograd.Function):
    """(hidden (T, H), lm_head weight (V, H), ids, teacher log-probs) -> as LeanTopK; the logits are
    recomputed per chunk (F.linear in the inputs' dtype, then fp32) and never held whole."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, t, clamp, with_tail, chunk):
        ids, t = _prepare(ids, t, chunk)
        with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
            trunc, tail, stats, saved = _forward_all(
                hidden.shape[0], hidden.device, chunk,
                lambda a, b: F.linear(hidden[a:b], weight).float(), ids, t, clamp, with_tail,
            )
        ctx.save_for_backward(hidden, weight, ids, *[x for x in saved if x is not None])
        ctx.with_tail, ctx.chunk = with_tail, chunk
        ctx.mark_non_differentiable(*stats.values())
        return trunc, tail, *stats.values()

    @staticmethod
    def backward(ctx, g_trunc, g_tail, *_):
        hidden, weight, ids, lse, wa, *tail_saved = ctx.saved_tensors
        tail_coef, lse_out = tail_saved if ctx.with_tail else (None, None)
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # fp32 accumulator
        g_trunc = torch.zeros(n, device=hidden.device) if g_trunc is None else g_trunc.float()
        use_tail = ctx.with_tail and g_tail is not None
        with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
            for a in range(0, n, ctx.chunk):
                b = min(a + ctx.chunk, n)
                z = F.linear(hidden[a:b], weight)
                extra = (g_tail[a:b].float(), tail_coef[a:b], lse_out[a:b]) if use_tail else ()
                g = _chunk_grad(z, ids[a:b], lse[a:b], wa[a:b], g_trunc[a:b], *extra).to(hidden.dtype)
                grad_h[a:b] = g @ weight
                # Each chunk's product in the weight's dtype (as lm_head's own backward), summed in fp32.
                grad_w.add_(g.t() @ hidden[a:b])
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def _unpack(outputs, with_tail):
    trunc, tail, *stats = outputs
    out = {"distillation_losses": trunc, **dict(zip(_STATS, stats))}
    if with_tail:
        out["tail_losses"] = tail
    return out


def lean_topk(logits, ids, teacher_logprobs, *, clamp=None, with_tail=False, chunk=DEFAULT_CHUNK):
    """Per-token outputs from (T, V) logits: distillation_losses (truncated), student_mass, teacher_mass,
    overlap_count, overlap_token_advantage, and tail_losses when with_tail. All (T,)."""
    return _unpack(LeanTopK.apply(logits, ids, teacher_logprobs, clamp, with_tail, chunk), with_tail)


def lean_topk_from_hidden(hidden, weight, ids, teacher_logprobs, *, clamp=None, with_tail=False, chunk=DEFAULT_CHUNK):
    """As lean_topk, from (T, H) hidden states and the (V, H) lm_head weight (no bias)."""
    return _unpack(LeanTopKFromHidden.apply(hidden, weight, ids, teacher_logprobs, clamp, with_tail, chunk), with_tail)


def topk_outputs(student_logits, teacher_ids, teacher_logprobs, loss_config, *, with_tail, chunk=DEFAULT_CHUNK):
    """Drop-in for upstream's fsdp `compute_forward_kl_topk` outputs (+ tail_losses), shapes (B, T).

    student_logits (B, T, V); teacher_ids / teacher_logprobs (B, T, K), aligned with them.
    """
    shape, v, k = student_logits.shape[:-1], student_logits.shape[-1], teacher_ids.shape[-1]
    out = lean_topk(
        student_logits.reshape(-1, v), teacher_ids.reshape(-1, k), teacher_logprobs.reshape(-1, k),
        clamp=loss_config.log_prob_min_clamp, with_tail=with_tail, chunk=chunk,
    )
    return {name: x.reshape(shape) for name, x in out.items()}
