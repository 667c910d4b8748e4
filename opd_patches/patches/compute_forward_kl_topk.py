"""Changes `verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk` (the top-k logits processor,
trainer/distillation/fsdp/losses.py:75 in VERL 0.9.1).

Why: the tail term of `forward_kl_topk_tail` needs the student logits, which exist only inside the actor's
forward pass, where VERL calls this function for every top-k loss (`compute_topk_loss` reads it from its
module on every call). The wrapper runs it unchanged and, for the tail loss only, adds one more per-token
output (`tail_losses`).
Memory-lean mode: when `opd.lean_topk` is on (opd_patches/config.py, losses/lean_topk.py), the same wrapper
computes both top-k losses with the memory-lean exact kernel instead of calling the original; the outputs
(keys, shapes, values, gradients) are the original's.
Accepts: without a loss_mode it knows (upstream's tests pass a namespace with no loss_mode; any other
loss), the original runs unchanged. In lean mode: the original's keys and shapes, values and gradients to
fp32 rounding, in the dtypes of upstream's fp32 maths (as under the actor's autocast; `use_chunked_topk`,
which upstream rounds to the logits' dtype, gets the fp32 values too).
"""

import functools

from opd_patches.patches import registry
from opd_patches.patches.registry import Upstream

CHANGES = (Upstream(
    "verl.trainer.distillation.fsdp.losses", "compute_forward_kl_topk",
    params=("student_logits", "teacher_topk_log_probs", "teacher_topk_ids", "config", "data_format"),
    # how the wrapper aligns the teacher tensors, and the semantics the lean kernel reproduces (losses/lean_topk.py)
    source=(
        "assert teacher_topk_log_probs.is_nested and teacher_topk_ids.is_nested",
        "teacher_topk_log_probs = teacher_topk_log_probs.values().unsqueeze(0)",
        "if get_ulysses_sequence_parallel_world_size() > 1:",
        "teacher_topk_log_probs = slice_input_tensor(teacher_topk_log_probs, dim=1)",
        "student_topk_log_probs.clamp_min(loss_config.log_prob_min_clamp)",
        "teacher_topk_log_probs.clamp_min(loss_config.log_prob_min_clamp)",
        "distillation_losses = kl_divergence(log_q=student_topk_log_probs, log_p=teacher_topk_log_probs)",
        "student_mass = student_topk_log_probs.exp().sum(dim=-1)",
    ),
),)
RELIES_ON = (
    # the logits processor looks the function up in its module at call time, so the wrapper is what runs
    Upstream("verl.trainer.distillation.losses", "compute_topk_loss",
             source=("distillation_loss_fn = fsdp_losses.compute_forward_kl_topk",)),
)
_ANNOUNCED = set()  # loss modes that announced their path in this process


def _wrap(original):
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    from opd_patches.losses import lean_topk
    from opd_patches.losses.forward_kl_topk_tail import NAME, tail_outputs

    def aligned(teacher_topk_log_probs, teacher_topk_ids):
        # Align the teacher tensors with the logits exactly as the original does (packed, SP-sliced).
        assert teacher_topk_log_probs.is_nested and teacher_topk_ids.is_nested  # as the original
        logprobs, ids = teacher_topk_log_probs.values().unsqueeze(0), teacher_topk_ids.values().unsqueeze(0)
        if get_ulysses_sequence_parallel_world_size() > 1:
            logprobs, ids = slice_input_tensor(logprobs, dim=1), slice_input_tensor(ids, dim=1)
        return logprobs, ids

    @functools.wraps(original)
    def compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format):
        # The original never reads loss_mode (upstream's tests pass a namespace without it): no mode
        # means not one of ours, so the original runs unchanged.
        mode = getattr(getattr(config, "distillation_loss", None), "loss_mode", None)
        if lean_topk.enabled() and mode in lean_topk.LOSS_MODES:
            # Memory-lean mode (losses/lean_topk.py): the same outputs, no (T, V) fp32 tensors.
            logprobs, ids = aligned(teacher_topk_log_probs, teacher_topk_ids)
            assert logprobs.shape[:2] == ids.shape[:2] == student_logits.shape[:2]
            if mode not in _ANNOUNCED:  # once per process and loss: say which path trains
                print(f"[opd] {mode}: memory-lean top-k kernel (opd.lean_topk)", flush=True)
                _ANNOUNCED.add(mode)
            return lean_topk.topk_outputs(student_logits, ids, logprobs, config.distillation_loss, with_tail=mode == NAME)
        outputs = original(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format)
        if mode != NAME:
            return outputs
        logprobs, ids = aligned(teacher_topk_log_probs, teacher_topk_ids)
        return {**outputs, **tail_outputs(student_logits, ids, logprobs)}

    return compute_forward_kl_topk


def apply():
    import verl.trainer.distillation.fsdp.losses as fsdp_losses

    return registry.apply(__name__, fsdp_losses, "compute_forward_kl_topk", _wrap)
