"""Changes `poll_interval` of the trainer's `verl.trainer.ppo.v1.replay_buffer.ReplayBuffer` instance
(set by its `__init__`, trainer/ppo/v1/replay_buffer.py:157 in VERL 0.9.1), to `opd.replay_poll_s`.

Why: upstream's sync sampler sleeps `poll_interval` (its constructor's default) between looks at
TransferQueue while the rollout runs, so every generation takes a whole number of those periods. Upstream
takes the interval only as a constructor argument that its builder (`PPOTrainer._build_replay_buffer`) never
passes, so there is no config key; the attribute is what its wait reads. Applied by the trainer mixin
(opd_patches/trainers/opd_sync.py).
"""

from opd_patches.patches import registry
from opd_patches.patches.registry import Upstream

CHANGES = (Upstream("verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer.poll_interval", instances=True),)
RELIES_ON = (
    Upstream("verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer._wait_for_next_poll",
             source=("time.sleep(self.poll_interval)",)),
    Upstream("verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer.sample", source=("self._wait_for_next_poll(",)),
)


def apply(replay_buffer, seconds: float):
    """Set `replay_buffer.poll_interval` to `seconds` (once per buffer)."""
    return registry.apply(__name__, replay_buffer, "poll_interval", lambda original: float(seconds))
