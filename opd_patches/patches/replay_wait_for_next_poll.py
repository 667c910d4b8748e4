"""Changes `_wait_for_next_poll` of the trainer's `verl.trainer.ppo.v1.replay_buffer.ReplayBuffer` instance
(trainer/ppo/v1/replay_buffer.py:408 in VERL 0.9.1): after each wait, a check of the caller's runs.

Why: upstream's sync trainer waits in `ReplayBuffer.sample` for a step's finished samples without a
deadline, calling this method between looks at TransferQueue; if a rollout-side actor dies meanwhile the
samples never arrive and the trainer would wait for ever. The check (opd_patches/ops/liveness.py, installed
by the trainer mixin) raises when one has died; the wait's own return value passes through.
"""

from typing import Callable

from opd_patches.patches import registry
from opd_patches.patches.registry import Upstream

CHANGES = (Upstream("verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer._wait_for_next_poll", instances=True,
                    params=("self", "partition_id", "last_debug_time")),)
RELIES_ON = (
    # both sample loops (sync and async buffers) wait there, without a deadline of their own
    Upstream("verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer.sample",
             source=("self._wait_for_next_poll(partition_id, last_debug_time)",)),
    Upstream("verl.trainer.ppo.v1.replay_buffer", "ReplayBufferAsync.wait_for_sampleable",
             source=("self._wait_for_next_poll(partition_id, last_debug_time)",)),
)


def apply(replay_buffer, after_wait: Callable[[], None]):
    """Call `after_wait()` after each of `replay_buffer`'s waits between looks at TransferQueue (once per buffer)."""

    def wrap(wait):
        def _wait_for_next_poll(partition_id, last_debug_time):
            out = wait(partition_id, last_debug_time)
            after_wait()
            return out

        return _wait_for_next_poll

    return registry.apply(__name__, replay_buffer, "_wait_for_next_poll", wrap)
