"""Top-k forward KL with a tail bucket: per-token maths, pure tensors (no Ray, no FSDP).

Convention (`forward_kl_topk_tail`):
- Direction: forward KL(teacher || student), at every position the student visited.
- Partition: S = the teacher's top-k token ids at that position, plus ONE tail bin holding every
  other token. Both distributions are coarsened to these k+1 bins; nothing is renormalised:
      p_T(j), p_S(j) for j in S;  tail masses 1 - m_T, 1 - m_S with m = sum_{j in S} p(j).
- Loss per position:
      L = sum_{j in S} p_T(j) (log p_T(j) - log p_S(j)) + (1 - m_T) (log(1 - m_T) - log(1 - m_S))
  which is the exact KL between the two (k+1)-bin distributions: L >= 0 with no clamp, L = 0 iff
  the student matches the teacher on the partition, and L equals the full-vocabulary KL when
  k = V. The teacher-entropy terms (p_T log p_T) are included, so L is a divergence, not a
  cross-entropy.
- Tail numerics: the student's tail is a log-sum-exp over the non-top-k logits (never 1 - sum);
  the teacher's is `log1mexp` of its top-k log-sum-exp. A teacher tail below `TAIL_EPS` (1e-6)
  counts as empty (its term is 0): below that, fp32 rounding of the teacher's top-k log-probs
  dominates the tail's value. Loss and gradient stay finite for k = V and for a teacher mass of 1.
- Shapes: student_logits (T, V), teacher_ids (T, K) int64, teacher_logprobs (T, K) -> (T,) fp32.
  Aggregation over tokens is the caller's (VERL's `agg_loss` with the actor's loss_agg_mode).

Upstream's `forward_kl_topk` is the first sum alone (the "truncated" KL); it can go negative, so
upstream clamps each token at 0, which also zeroes that token's gradient.
"""

import math

import torch

TAIL_EPS = 1e-6
_LOG_TAIL_EPS = math.log(TAIL_EPS)
# Floor for the student's tail log-mass: keeps L finite (huge, not inf) when the student puts
# numerically no mass outside S while the teacher does.
_LOG_FLOOR = -1e4


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate across the range (Maechler 2012)."""
    x = x.clamp(max=0.0)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def truncated_kl_per_token(student_logits, teacher_ids, teacher_logprobs) -> torch.Tensor:
    """sum_{j in S} p_T(j) (log p_T(j) - log p_S(j)): upstream's forward_kl_topk before its clamp."""
    z = student_logits.float()
    student_top = z.gather(-1, teacher_ids) - torch.logsumexp(z, dim=-1, keepdim=True)
    teacher_top = teacher_logprobs.float()
    return (teacher_top.exp() * (teacher_top - student_top)).sum(-1)


def tail_term_per_token(student_logits, teacher_ids, teacher_logprobs) -> torch.Tensor:
    """(1 - m_T) (log(1 - m_T) - log(1 - m_S)); 0 where the teacher's tail is below TAIL_EPS."""
    z = student_logits.float()
    log_z = torch.logsumexp(z, dim=-1)
    # A large finite fill, not -inf: with k = V every entry is masked, and logsumexp over all -inf
    # has a NaN gradient even where the result is discarded.
    outside = z.scatter(-1, teacher_ids, -1e30)
    student_tail = (torch.logsumexp(outside, dim=-1) - log_z).clamp(min=_LOG_FLOOR)
    teacher_tail = log1mexp(torch.logsumexp(teacher_logprobs.float(), dim=-1))
    has_tail = teacher_tail > _LOG_TAIL_EPS
    # Double `where`: masked positions get harmless inputs, so no NaN/inf leaks into the gradient.
    teacher_tail = torch.where(has_tail, teacher_tail, torch.zeros_like(teacher_tail))
    student_tail = torch.where(has_tail, student_tail, torch.zeros_like(student_tail))
    term = teacher_tail.exp() * (teacher_tail - student_tail)
    return torch.where(has_tail, term, torch.zeros_like(term))


def tail_kl_per_token(student_logits, teacher_ids, teacher_logprobs) -> torch.Tensor:
    """Per-token KL between the (k+1)-bin coarsenings of teacher and student (see module docstring).

    Args:
        student_logits: (T, V) student logits at the student-visited positions (any float dtype).
        teacher_ids: (T, K) the teacher's top-k token ids at those positions.
        teacher_logprobs: (T, K) the teacher's log-probabilities of those ids (full softmax, T = 1).
    Returns:
        (T,) fp32 losses, differentiable with respect to student_logits.
    """
    teacher_ids = teacher_ids.long()
    return truncated_kl_per_token(student_logits, teacher_ids, teacher_logprobs) + tail_term_per_token(
        student_logits, teacher_ids, teacher_logprobs
    )
