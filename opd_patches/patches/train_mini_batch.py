"""Changes `train_mini_batch` of a worker's actor, a `verl.workers.engine_workers.TrainingWorker` instance
(workers/engine_workers.py:243 in VERL 0.9.1), where opd.debug.profile_update asks for it (bench only).

Why: `ActorRolloutRefWorker.update_actor` runs each mini-batch through `self.actor.train_mini_batch`, the
one call that holds a whole update; wrapping it on the instance times (and, for one update, profiles) it
on every rank without touching the class (opd_patches/hooks/profile_update.py).
"""

from typing import Callable

from opd_patches.patches import registry
from opd_patches.patches.registry import Upstream

CHANGES = (Upstream("verl.workers.engine_workers", "TrainingWorker.train_mini_batch", instances=True,
                    params=("self", "data")),)
RELIES_ON = (
    Upstream("verl.workers.engine_workers", "ActorRolloutRefWorker.update_actor",
             source=("self.actor.train_mini_batch(data=data)",)),
)


def apply(actor, around: Callable):
    """`actor.train_mini_batch(*a, **k)` becomes `around(original, *a, **k)` (once per actor)."""

    def wrap(original):
        def train_mini_batch(*args, **kwargs):
            return around(original, *args, **kwargs)

        return train_mini_batch

    return registry.apply(__name__, actor, "train_mini_batch", wrap)
