"""Changes `verl.workers.config.distillation.DistillationTeacherModelConfig._validate_topk_logprobs`
(workers/config/distillation.py:188 in VERL 0.9.1).

Why: upstream accepts only vllm/sglang for top-k teachers and raises NotImplementedError otherwise. The `hf`
backend (opd_patches/rollout/hf.py) returns any number of prompt log-probs, so there is nothing to
validate for it.
Accepts: the original's outcome for every call except `hf` with use_topk and a topk (upstream:
NotImplementedError; here: valid); the original alone reads `self.inference` otherwise.
"""

import functools

from opd_patches.patches import registry
from opd_patches.patches.registry import Upstream

CHANGES = (Upstream("verl.workers.config.distillation", "DistillationTeacherModelConfig._validate_topk_logprobs",
                    params=("self", "use_topk", "topk"),
                    source=("if not use_topk:\n            return", "if topk is None:",
                            'f"DistillationTeacherModelConfig does not support inference engine {engine_name}"')),)
RELIES_ON = ()


def _wrap(original):
    @functools.wraps(original)
    def _validate_topk_logprobs(self, use_topk, topk):
        # Only the one case upstream refuses changes; the original makes its own early returns and
        # errors first (no top-k, topk missing) and is the one to read `self.inference`.
        if use_topk and topk is not None and self.inference.name == "hf":
            return None
        return original(self, use_topk, topk)

    return _validate_topk_logprobs


def apply():
    # Imported here, as in every patch: importing a patch file must not import verl, whose own import
    # registers opd_patches (VERL_USE_EXTERNAL_MODULES) and so applies the patches.
    from verl.workers.config.distillation import DistillationTeacherModelConfig

    return registry.apply(__name__, DistillationTeacherModelConfig, "_validate_topk_logprobs", _wrap)
