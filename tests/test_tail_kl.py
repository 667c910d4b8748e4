"""`tail_kl_per_token` against an independent float64 full-softmax reference.

The reference coarsens both full distributions to the (k+1) bins {each teacher top-k token, the
rest} with plain probabilities and computes sum p log(p/q) over bins; gradients come from autograd
through it. Adversarial inputs: peaked teachers, tiny tails, k = V, equal logits, extreme logits.
"""

import math

import pytest
import torch

from opd_patches.losses import tail_kl_per_token, tail_term_per_token, truncated_kl_per_token
from opd_patches.losses.tail_kl import TAIL_EPS


def coarse_kl_reference(student_logits, teacher_logprobs_full, ids):
    """KL(coarse teacher || coarse student) in float64 from full distributions."""
    ps = torch.softmax(student_logits.double(), -1)
    pt = teacher_logprobs_full.double().exp()

    def coarse(p):
        top = p.gather(-1, ids)
        return torch.cat([top, (p.sum(-1, keepdim=True) - top.sum(-1, keepdim=True)).clamp_min(0)], -1)

    ct, cs = coarse(pt), coarse(ps)
    terms = torch.where(ct > 0, ct * (ct.clamp_min(1e-300).log() - cs.clamp_min(1e-300).log()), torch.zeros_like(ct))
    return terms.sum(-1)


def teacher_topk(teacher_logits, k):
    full = torch.log_softmax(teacher_logits.double(), -1)
    lp, ids = full.topk(k, -1)
    return full, lp.float(), ids


def check_against_reference(student_logits, teacher_logits, k, atol=1e-5, grad_atol=1e-5):
    full, lp, ids = teacher_topk(teacher_logits, k)
    z = student_logits.clone().requires_grad_(True)
    z_ref = student_logits.double().clone().requires_grad_(True)
    loss = tail_kl_per_token(z, ids, lp)
    ref = coarse_kl_reference(z_ref, full, ids)
    assert loss.dtype == torch.float32 and loss.shape == (student_logits.shape[0],)
    torch.testing.assert_close(loss.double(), ref, atol=atol, rtol=1e-4)
    weights = torch.rand(loss.shape[0], dtype=torch.float64)  # a generic linear functional of the losses
    (loss.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    assert torch.isfinite(z.grad).all()
    torch.testing.assert_close(z.grad.double(), z_ref.grad, atol=grad_atol, rtol=1e-3)
    return loss


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("T", "V", "K"), [(1, 2, 1), (7, 32, 4), (16, 300, 16), (5, 64, 63)])
def test_matches_reference_on_random_inputs(seed, T, V, K):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(T, V, generator=g) * 2
    teacher = torch.randn(T, V, generator=g) * 3
    loss = check_against_reference(student, teacher, K)
    assert (loss >= -1e-6).all()


def test_k_equals_v_is_the_full_kl():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, 40, generator=g), torch.randn(6, 40, generator=g) * 2
    full, lp, ids = teacher_topk(teacher, 40)
    z = student.clone().requires_grad_(True)
    loss = tail_kl_per_token(z, ids, lp)
    exact = (full.exp() * (full - torch.log_softmax(student.double(), -1))).sum(-1)
    torch.testing.assert_close(loss.double(), exact, atol=1e-5, rtol=1e-5)
    loss.sum().backward()
    assert torch.isfinite(z.grad).all()
    # Gradient of the full forward KL w.r.t. logits: softmax(z) - p_T.
    torch.testing.assert_close(z.grad.double(), torch.softmax(student.double(), -1) - full.exp(), atol=1e-5, rtol=0)


def test_closed_form_two_token_case():
    # V = 2, k = 1: the bins are the two tokens, so L = KL(Bernoulli(0.75) || Bernoulli(0.5)).
    teacher_lp = torch.tensor([[math.log(0.75)]])
    ids = torch.tensor([[0]])
    student = torch.tensor([[0.0, 0.0]])
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)  # 0.130812...
    assert tail_kl_per_token(student, ids, teacher_lp).item() == pytest.approx(expected, abs=1e-6)
    assert truncated_kl_per_token(student, ids, teacher_lp).item() == pytest.approx(0.75 * math.log(1.5), abs=1e-6)


def test_zero_iff_student_matches_the_partition():
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(4, 50, generator=g) * 2
    full, lp, ids = teacher_topk(teacher, 5)
    # Same distribution: zero loss and zero gradient.
    z = full.float().clone().requires_grad_(True)
    loss = tail_kl_per_token(z, ids, lp)
    assert loss.abs().max() < 1e-6
    loss.sum().backward()
    assert z.grad.abs().max() < 1e-6
    # Reshuffle probability among tail tokens only: coarse distributions still agree -> L = 0,
    # while the full KL is clearly positive.
    p = full.exp().clone()
    in_top = torch.zeros_like(p, dtype=torch.bool).scatter(-1, ids, True)
    tail = torch.where(in_top, torch.zeros_like(p), p)
    reshuffled = tail.roll(1, dims=-1) * (~in_top)
    reshuffled = reshuffled / reshuffled.sum(-1, keepdim=True) * tail.sum(-1, keepdim=True)
    q = torch.where(in_top, p, reshuffled)
    assert (p * (p.log() - q.log())).sum(-1).min() > 1e-3
    assert tail_kl_per_token(q.log().float(), ids, lp).abs().max() < 1e-5
    # Move mass between a top-k token and the tail: positive loss.
    assert (tail_kl_per_token(torch.zeros(4, 50), ids, lp) > 1e-3).all()


@pytest.mark.parametrize("tail_mass", [0.5, 1e-3, 1e-5, 2e-6, 5e-7, 1e-9, 0.0])
def test_peaked_teacher_and_tiny_tails_stay_finite(tail_mass):
    """Teacher puts 1 - tail_mass on k tokens; student anything. Loss >= 0, finite, gradient finite."""
    V, K = 100, 3
    teacher = torch.full((3, V), -1e9, dtype=torch.float64)
    teacher[:, :K] = 0.0
    if tail_mass > 0:
        teacher[:, K:] = math.log(tail_mass / (V - K)) - math.log((1 - tail_mass) / K)
    g = torch.Generator().manual_seed(2)
    for student in (torch.randn(3, V, generator=g), torch.zeros(3, V), torch.randn(3, V, generator=g) * 30):
        full, lp, ids = teacher_topk(teacher, K)
        z = student.clone().requires_grad_(True)
        loss = tail_kl_per_token(z, ids, lp)
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(z.grad).all()
        assert (loss >= -1e-5).all()
        if tail_mass >= 1e-5:  # above float rounding the tail term must match the reference
            ref = coarse_kl_reference(student, full, ids)
            torch.testing.assert_close(loss.double(), ref, atol=1e-4, rtol=1e-3)


def test_tail_below_eps_counts_as_empty():
    V, K = 10, 3
    teacher = torch.zeros(1, V, dtype=torch.float64)
    teacher[:, K:] = math.log(TAIL_EPS / 10 / (V - K)) - math.log(1 / K)
    _, lp, ids = teacher_topk(teacher, K)
    assert tail_term_per_token(torch.randn(1, V), ids, lp).item() == 0.0


def test_extreme_student_logits():
    """A student with (numerically) no tail mass where the teacher has some: huge but finite."""
    V, K = 20, 2
    student = torch.full((1, V), -200.0)
    student[:, :K] = 200.0
    teacher = torch.zeros(1, V)
    _, lp, ids = teacher_topk(teacher, K)
    ids = torch.tensor([[0, 1]])
    z = student.clone().requires_grad_(True)
    loss = tail_kl_per_token(z, ids, lp)
    loss.backward()
    assert torch.isfinite(loss).all() and loss.item() > 100
    assert torch.isfinite(z.grad).all()


def test_bf16_logits_are_computed_in_fp32():
    g = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    _, lp, ids = teacher_topk(teacher, 8)
    a = tail_kl_per_token(student.bfloat16(), ids, lp)
    b = tail_kl_per_token(student.bfloat16().float(), ids, lp)
    assert a.dtype == torch.float32
    torch.testing.assert_close(a, b)
