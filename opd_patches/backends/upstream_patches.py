"""The only places where upstream behaviour is patched at run time (VERL 0.9.1 and torch).

Each patch is small, idempotent, and guarded by tests/test_upstream_patches.py, which fails
loudly if the patched upstream function moves or changes shape.

1. `cpu:gloo,cpu:gloo`: VERL builds the process-group backend as
   `f"cpu:gloo,{device}:{backend}"` (verl/utils/distributed.py); on the CPU platform that
   names the CPU twice and torch refuses it. We drop repeated `device:backend` entries.
2. Top-k teachers served by the `hf` backend: `DistillationTeacherModelConfig.
   _validate_topk_logprobs` (verl/workers/config/distillation.py) accepts only vllm/sglang
   and raises NotImplementedError otherwise. The HF backend returns any number of
   prompt log-probs, so there is nothing to validate for it.
3. The tail term of `forward_kl_topk_tail` needs the student logits, which exist only inside the
   actor's forward pass, where VERL calls `verl.trainer.distillation.fsdp.losses.
   compute_forward_kl_topk` for every top-k loss. We wrap that one function: it runs unchanged and,
   for the tail loss only, adds one more per-token output (`tail_losses`).
4. Upstream's registered `forward_kl_topk` clamps negative per-token losses at 0 without saying how
   often; its registry entry is wrapped to also report `distillation/clamped_frac`.
"""

import functools

import torch.distributed
from verl.workers.config.distillation import DistillationTeacherModelConfig

_MARK = "_opd_patched"


def dedupe_backend(backend):
    """'cpu:gloo,cpu:gloo' -> 'cpu:gloo'; anything else is returned unchanged."""
    if not isinstance(backend, str) or "," not in backend:
        return backend
    parts = []
    for part in backend.split(","):
        if part not in parts:
            parts.append(part)
    return ",".join(parts)


def _patch_init_process_group():
    original = torch.distributed.init_process_group
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = dedupe_backend(kwargs["backend"])
        elif args:
            args = (dedupe_backend(args[0]),) + args[1:]
        return original(*args, **kwargs)

    setattr(init_process_group, _MARK, True)
    torch.distributed.init_process_group = init_process_group


def _patch_topk_validation():
    original = DistillationTeacherModelConfig._validate_topk_logprobs
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def _validate_topk_logprobs(self, use_topk, topk):
        if self.inference.name == "hf":
            if use_topk and topk is None:
                raise ValueError("topk must be specified when use_topk is True.")
            return None
        return original(self, use_topk, topk)

    setattr(_validate_topk_logprobs, _MARK, True)
    DistillationTeacherModelConfig._validate_topk_logprobs = _validate_topk_logprobs


def _patch_topk_logits_processor():
    import verl.trainer.distillation.fsdp.losses as fsdp_losses
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    from opd_patches.losses.forward_kl_topk_tail import NAME, tail_outputs

    original = fsdp_losses.compute_forward_kl_topk
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format):
        outputs = original(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format)
        if config.distillation_loss.loss_mode != NAME:
            return outputs
        # Align the teacher tensors with the logits exactly as the original does (packed, SP-sliced).
        logprobs, ids = teacher_topk_log_probs.values().unsqueeze(0), teacher_topk_ids.values().unsqueeze(0)
        if get_ulysses_sequence_parallel_world_size() > 1:
            logprobs, ids = slice_input_tensor(logprobs, dim=1), slice_input_tensor(ids, dim=1)
        return {**outputs, **tail_outputs(student_logits, ids, logprobs)}

    setattr(compute_forward_kl_topk, _MARK, True)
    fsdp_losses.compute_forward_kl_topk = compute_forward_kl_topk


def _patch_forward_kl_topk_metrics():
    from verl.trainer.distillation import losses as distill_losses
    from verl.workers.utils.padding import no_padding_2_padding

    from opd_patches.losses.forward_kl_topk_tail import clamp_fraction, response_mask_of

    original = distill_losses.DISTILLATION_LOSS_REGISTRY["forward_kl_topk"]
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def compute_forward_kl_topk(config, distillation_config, model_output, data):
        losses, metrics = original(config, distillation_config, model_output, data)
        truncated = no_padding_2_padding(model_output["distillation_losses"], data).detach()
        metrics["distillation/clamped_frac"] = clamp_fraction(truncated, response_mask_of(data))
        return losses, metrics

    setattr(compute_forward_kl_topk, _MARK, True)
    distill_losses.DISTILLATION_LOSS_REGISTRY["forward_kl_topk"] = compute_forward_kl_topk


def apply():
    _patch_init_process_group()
    _patch_topk_validation()
    _patch_topk_logits_processor()
    _patch_forward_kl_topk_metrics()
