"""Changes `verl.utils.checkpoint.fsdp_checkpoint_manager.FSDPCheckpointManager.save_checkpoint`
(utils/checkpoint/fsdp_checkpoint_manager.py:272 in VERL 0.9.1) in a run's workers with
`opd.background_state_write` on (ops/state_writer.py `enabled`), and, for
the duration of each call, that module's global `torch`.

Why: state files written in the background (`opd.background_state_write`, ops/state_writer.py).
`save_checkpoint` calls `torch.save(obj, path)` through its module's global `torch`; while it runs,
`deferred_saves` makes that global a module proxy whose `save` snapshots `obj` to host memory and queues it
for a writer thread (every other attribute is torch's), and puts torch back on the way out.
Accepts: everything the original does; file objects (not paths) and tensor types other than Tensor/DTensor
(FSDP1's ShardedTensor) are written at once, as the original would.
"""

import contextlib
import functools

from opd_patches.patches import registry
from opd_patches.patches.registry import Upstream

MODULE = "verl.utils.checkpoint.fsdp_checkpoint_manager"
CHANGES = (
    Upstream(MODULE, "FSDPCheckpointManager.save_checkpoint",
             params=("self", "local_path", "hdfs_path", "global_step", "max_ckpt_to_keep"),
             # the three state files, each written through the module's global `torch`
             source=("torch.save(model_state_dict, model_path)", "torch.save(optimizer_state_dict, optim_path)",
                     "torch.save(extra_state_dict, extra_path)")),
    Upstream(MODULE, "torch"),  # swapped only inside save_checkpoint (deferred_saves)
)
RELIES_ON = ()


@contextlib.contextmanager
def deferred_saves(module, writer=None):
    """While inside, `module`'s global name `torch` defers `torch.save(obj, path)` to the writer thread."""
    from opd_patches.ops import state_writer

    with registry.swapped(__name__, module, "torch", state_writer._TorchDeferredSave(writer or state_writer._WRITER)):
        yield


def _wrap(module):
    def wrap(original):
        @functools.wraps(original)
        def save_checkpoint(self, *args, **kwargs):
            with deferred_saves(module):
                return original(self, *args, **kwargs)

        return save_checkpoint

    return wrap


def apply():
    from opd_patches.ops import state_writer

    if not state_writer.enabled():
        return
    from verl.utils.checkpoint import fsdp_checkpoint_manager as module

    return registry.apply(__name__, module.FSDPCheckpointManager, "save_checkpoint", _wrap(module))
