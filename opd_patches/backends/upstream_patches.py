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


def apply():
    _patch_init_process_group()
    _patch_topk_validation()
