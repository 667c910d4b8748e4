"""opd.replay_poll_s (opd_patches/ops/trainer.py): upstream's sync ReplayBuffer sleeps `poll_interval`
(a constructor argument, 2.0 s, that its builder never passes) between looks at TransferQueue. The
trainer overrides the attribute; this fails loudly when upstream renames or stops reading it."""

import inspect

from verl.trainer.ppo.v1 import replay_buffer, trainer_base

import opd_patches  # noqa: F401

from opd_patches.ops import trainer as ops_trainer


def test_upstream_still_waits_on_the_attribute_we_set():
    sig = inspect.signature(replay_buffer.ReplayBuffer.__init__)
    assert sig.parameters["poll_interval"].default == 2.0
    assert "time.sleep(self.poll_interval)" in inspect.getsource(replay_buffer.ReplayBuffer._wait_for_next_poll)
    assert "self._wait_for_next_poll(" in inspect.getsource(replay_buffer.ReplayBuffer.sample)
    # the builder passes no poll_interval (else a config key would exist and this patch would not be needed)
    assert "poll_interval" not in inspect.getsource(trainer_base.PPOTrainer._build_replay_buffer)


def test_the_mixin_sets_it_from_the_recipe_key():
    src = inspect.getsource(ops_trainer.OpsTrainerMixin.__init__)
    assert 'opd.get("replay_poll_s", 0.05)' in src and "self.replay_buffer.poll_interval" in src
