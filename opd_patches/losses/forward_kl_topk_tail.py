"""The registered loss `forward_kl_topk_tail` (see tail_kl.py for the maths and its convention).

VERL computes top-k losses in two places: per token inside the actor's forward pass (the
"logits processor", where the student logits exist), then aggregated by the registered loss.
The truncated top-k sum is upstream's own per-token output (`distillation_losses`); the tail
term needs the logits, so the run-time patch opd_patches/patches/compute_forward_kl_topk.py adds it
there as `tail_losses`, differentiable, and this loss sums the two without any clamp.
"""

import torch
from verl.trainer.distillation.losses import (
    DistillationLossSettings,
    get_distillation_loss_fn,
    register_distillation_loss,
)
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.padding import no_padding_2_padding

from opd_patches.losses.tail_kl import tail_term_per_token

NAME = "forward_kl_topk_tail"


def tail_outputs(student_logits, teacher_ids, teacher_logprobs) -> dict[str, torch.Tensor]:
    """Extra per-token outputs of the logits processor for this loss; shapes (B, T) like upstream's.

    student_logits (B, T, V); teacher_ids / teacher_logprobs (B, T, K), already aligned with it.
    """
    v, k = student_logits.shape[-1], teacher_ids.shape[-1]
    tail = tail_term_per_token(
        student_logits.reshape(-1, v), teacher_ids.reshape(-1, k).long(), teacher_logprobs.reshape(-1, k)
    )
    return {"tail_losses": tail.reshape(student_logits.shape[:-1])}


def response_mask_of(data) -> torch.Tensor:
    mask = data["response_mask"]
    return (mask.bool().to_padded_tensor(False) if mask.is_nested else mask.bool())


def clamp_fraction(truncated: torch.Tensor, mask: torch.Tensor) -> Metric:
    """Share of response tokens whose truncated top-k KL is negative (upstream's clamp zeroes them)."""
    return Metric(AggregationType.MEAN, (truncated[mask] < 0).float().mean())


def _ensure_registered():
    try:
        get_distillation_loss_fn(NAME)
        return
    except ValueError:
        pass

    @register_distillation_loss(DistillationLossSettings(names=[NAME], use_topk=True))
    def compute_forward_kl_topk_tail(config, distillation_config, model_output, data):
        """Per-token (k+1)-bin forward KL: upstream's truncated top-k sum + the tail-bin term, no clamp.

        Returns (bsz, resp_len) losses for VERL's aggregation and the top-k metrics.
        """
        if "tail_losses" not in model_output:
            raise RuntimeError(
                f"{NAME}: the logits processor produced no tail_losses; the hook in "
                "opd_patches/patches/compute_forward_kl_topk.py is not applied in this worker "
                "(does VERL_USE_EXTERNAL_MODULES name opd_patches.registered?)."
            )
        truncated = no_padding_2_padding(model_output["distillation_losses"], data)
        tail = no_padding_2_padding(model_output["tail_losses"], data)
        # Upstream's metrics (masses, overlap) from the same outputs; its clamped losses are not used.
        _, metrics = get_distillation_loss_fn("forward_kl_topk")(config, distillation_config, model_output, data)
        losses = truncated + tail
        mask = response_mask_of(data)
        # The two parts can have opposite signs, so the share is of magnitudes: per token
        # |tail| / (|truncated| + |tail|), averaged over response tokens (0: tail irrelevant, 1: all tail).
        t, r = tail[mask].detach().abs(), truncated[mask].detach().abs()
        metrics["distillation/tail_share"] = Metric(AggregationType.MEAN, (t / (t + r).clamp_min(1e-12)).mean())
        metrics["distillation/tail_loss"] = Metric(AggregationType.MEAN, tail[mask].detach().mean())
        metrics["distillation/clamped_frac"] = clamp_fraction(truncated.detach(), mask)
        return losses, metrics


_ensure_registered()
