"""Changes the entry `forward_kl_topk` of `verl.trainer.distillation.losses.DISTILLATION_LOSS_REGISTRY`
(upstream's registered `compute_forward_kl_topk`, trainer/distillation/losses.py:306 in VERL 0.9.1).

Why: upstream's registered `forward_kl_topk` clamps negative per-token losses at 0 without saying how
often; its registry entry is wrapped to also report `distillation/clamped_frac` (the share of response
tokens the clamp zeroed). `register_distillation_loss` refuses a name twice, so the entry itself is replaced.
Accepts: exactly what the original accepts (it is called first, with the same arguments); returns its
losses and metrics plus that one key.
"""

import functools

from opd_patches.patches import registry
from opd_patches.patches.registry import Upstream

CHANGES = (Upstream("verl.trainer.distillation.losses", "DISTILLATION_LOSS_REGISTRY", key="forward_kl_topk",
                    params=("config", "distillation_config", "model_output", "data"),
                    source=('no_padding_2_padding(model_output["distillation_losses"], data)',
                            "distillation_losses = distillation_losses.clamp_min(0.0)")),)
RELIES_ON = (
    # the loss is looked up in the registry at call time
    Upstream("verl.trainer.distillation.losses", "get_distillation_loss_fn",
             source=("return DISTILLATION_LOSS_REGISTRY[loss_name]",)),
)


def _wrap(original):
    from verl.workers.utils.padding import no_padding_2_padding

    from opd_patches.losses.forward_kl_topk_tail import clamp_fraction, response_mask_of

    @functools.wraps(original)
    def compute_forward_kl_topk(config, distillation_config, model_output, data):
        losses, metrics = original(config, distillation_config, model_output, data)
        truncated = no_padding_2_padding(model_output["distillation_losses"], data).detach()
        metrics["distillation/clamped_frac"] = clamp_fraction(truncated, response_mask_of(data))
        return losses, metrics

    return compute_forward_kl_topk


def apply():
    from verl.trainer.distillation import losses

    return registry.apply(__name__, losses, "DISTILLATION_LOSS_REGISTRY", _wrap, key="forward_kl_topk")
