"""Changes `verl.utils.torch_functional.logprobs_from_logits_v2` (utils/torch_functional.py:173 in VERL 0.9.1).

Why: without flash-attn, `logprobs_from_logits` falls back to `logprobs_from_logits_v2`, a Python loop over
rows for bf16 logits (one log_softmax per token: far slower than one batched log_softmax).
`logprobs_from_logits` reads `logprobs_from_logits_v2` from its module's globals on every call, so
replacing that one module attribute reaches every `from ... import logprobs_from_logits` binding (the
FSDP engine's included) and nothing else: flash-attn and NPU keep their paths. On (`opd.fast_logprobs`,
opd_patches/config.py), it runs the exact chunked kernel of losses/sampled_logprob.py; off, the original.
Accepts: off, the original. On, every (logits (..., V), labels (...)) the original takes, plus empty
batches and IGNORE_INDEX labels (the original raises); fp32 values (fp64 for fp64): for bf16 logits the
original returns bf16-rounded values, CUDA autocast upstream fp32 as here. No double backward
(create_graph), which the original's plain autograd would allow; no caller asks for it.
"""

import functools

from opd_patches.patches import registry
from opd_patches.patches.registry import Upstream

CHANGES = (Upstream("verl.utils.torch_functional", "logprobs_from_logits_v2", params=("logits", "labels"),
                    # the semantics the kernel reproduces: fp32 logsumexp for fp32/fp64, per-row log_softmax otherwise
                    source=("torch.logsumexp(logit, dim=-1)", "F.log_softmax(row_logits, dim=-1)")),)
RELIES_ON = (
    # the fallback is looked up in the module's globals at call time, after the flash-attn and NPU branches
    Upstream("verl.utils.torch_functional", "logprobs_from_logits",
             source=("if _use_flash_ce:", "elif NPU_CROSS_ENTROPY_LOSS_AVAILABLE:",
                     "    else:\n        output = logprobs_from_logits_v2(logits, labels)")),
)
_ANNOUNCED = set()  # once per process: say which path computes log-probs


def _wrap(original):
    from opd_patches.losses import sampled_logprob

    @functools.wraps(original)
    def logprobs_from_logits_v2(logits, labels):
        if not sampled_logprob.enabled():
            return original(logits, labels)
        if "sampled_logprob" not in _ANNOUNCED:
            print("[opd] sampled-token log-probs: chunked exact kernel (opd.fast_logprobs)", flush=True)
            _ANNOUNCED.add("sampled_logprob")
        return sampled_logprob.sampled_logprobs(logits, labels)

    return logprobs_from_logits_v2


def apply():
    import verl.utils.torch_functional as verl_F

    return registry.apply(__name__, verl_F, "logprobs_from_logits_v2", _wrap)
