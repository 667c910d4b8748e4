"""Changes `verl.utils.torch_functional.entropy_from_logits` and `entropy_from_logits_with_chunking`
(utils/torch_functional.py:231 and :248 in VERL 0.9.1), in the workers of a run whose update computes the
entropy only as a metric (`entropy_detached` in opd_patches/config.py, resolved by opd_patches.main).

Why: with the student's old-log-prob pass skipped (`opd.skip_old_log_prob`), the update computes the
entropy only for the `actor/entropy` metric; at entropy_coeff 0 it contributes 0 to the loss, so both
functions run on detached logits: same values, no (T, V) autograd graph kept for a zero gradient. The FSDP
engine reads them at construction. They run eager: VERL's engine wraps the entropy in
torch.compile(dynamic=True), and dynamo specialised it on each micro-batch's token count and recompiled it
inside the update. Under no_grad, the unchunked one in row chunks of ENTROPY_ROWS.
Accepts: the original's values for every input it takes, detached.
"""

import functools

import torch

from opd_patches import config
from opd_patches.patches import registry
from opd_patches.patches.registry import Upstream

NAMES = ("entropy_from_logits", "entropy_from_logits_with_chunking")
CHANGES = (
    Upstream("verl.utils.torch_functional", "entropy_from_logits", params=("logits",)),
    Upstream("verl.utils.torch_functional", "entropy_from_logits_with_chunking", params=("logits", "chunk_size")),
)
RELIES_ON = (
    # the engine reads both functions from the module when it is constructed (after registration)
    Upstream("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine.__init__",
             source=("verl_F.entropy_from_logits_with_chunking", "verl_F.entropy_from_logits\n")),
)
ENTROPY_ROWS = 4096  # rows per chunk of the metric-only entropy (a 4096 x 151,936 bf16 softmax: 1.2 GB)


# dynamo stops at this function (torch.compile unwraps a disabled function handed to it directly, hence the
# call one level down).
@torch.compiler.disable
def _metric_entropy(original, name, logits, args, kwargs):
    with torch.no_grad():
        logits = logits.detach()
        if name == "entropy_from_logits" and logits.dim() == 2 and logits.shape[0] > ENTROPY_ROWS:
            # row-wise maths: chunks give the same values without a (T, V) softmax at once
            return torch.cat([original(c) for c in logits.split(ENTROPY_ROWS)])
        return original(logits, *args, **kwargs)


def _wrap(name):
    def wrap(original):
        def detached(logits, *args, **kwargs):
            return _metric_entropy(original, name, logits, args, kwargs)

        return functools.update_wrapper(detached, original)

    return wrap


def apply():
    if not config.current().entropy_detached:
        return
    import verl.utils.torch_functional as verl_F

    for name in NAMES:
        registry.apply(__name__, verl_F, name, _wrap(name))
