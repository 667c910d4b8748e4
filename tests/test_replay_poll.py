"""opd.replay_poll_s (opd_patches/trainers/opd_sync.py): upstream's sync ReplayBuffer sleeps `poll_interval`
(a constructor argument, 2.0 s, that its builder never passes) between looks at TransferQueue. The
trainer overrides the attribute; this fails loudly when upstream renames or stops reading it."""

import inspect
import time
import types

import pytest
from omegaconf import open_dict
from verl.trainer.ppo.v1 import replay_buffer, trainer_base

import opd_patches  # noqa: F401

from opd_patches.trainers import opd_sync as ops_trainer
from test_config import compose_recipe


def test_upstream_still_waits_on_the_attribute_we_set():
    sig = inspect.signature(replay_buffer.ReplayBuffer.__init__)
    assert sig.parameters["poll_interval"].default == 2.0
    assert "time.sleep(self.poll_interval)" in inspect.getsource(replay_buffer.ReplayBuffer._wait_for_next_poll)
    assert "self._wait_for_next_poll(" in inspect.getsource(replay_buffer.ReplayBuffer.sample)
    # the builder passes no poll_interval (else a config key would exist and this patch would not be needed)
    assert "poll_interval" not in inspect.getsource(trainer_base.PPOTrainer._build_replay_buffer)


class _Upstream:
    """The part of upstream's `PPOTrainer.__init__` the mixin builds on: the config, and the replay buffer
    made by upstream's own builder (no Ray, no workers)."""

    _build_replay_buffer = trainer_base.PPOTrainer._build_replay_buffer
    _resolve_filter_groups_metric = trainer_base.PPOTrainer._resolve_filter_groups_metric
    _add_prompts_to_generate = None  # the builder's refill_fn: never called here

    def __init__(self, config):
        self.config = config
        self.replay_buffer = self._build_replay_buffer()


class MixinTrainer(ops_trainer.OpsTrainerMixin, _Upstream):
    """The mixin in front of upstream's trainer, as `opd_sync` puts it (MRO)."""


def mixin_trainer(*overrides, drop=()):
    """The mixin's trainer for the k1 recipe with `overrides`; `drop`: opd keys removed (a config without them)."""
    config = compose_recipe("k1", *overrides)
    with open_dict(config):
        for key in drop:
            del config.opd[key]
    return MixinTrainer(config)


def slept_by_upstream_wait(trainer, monkeypatch) -> list[float]:
    """What upstream's poll wait sleeps, recorded instead of slept (replay_buffer's own `time` only)."""
    slept = []
    monkeypatch.setattr(replay_buffer, "time", types.SimpleNamespace(sleep=slept.append, time=time.time))
    trainer.replay_buffer._wait_for_next_poll("train", time.time())
    return slept


def test_the_mixin_sets_it_from_the_recipe_key(monkeypatch):
    recipe = mixin_trainer()
    assert type(recipe.replay_buffer) is replay_buffer.ReplayBuffer  # upstream's own, built as upstream does
    assert slept_by_upstream_wait(recipe, monkeypatch) == [recipe.config.opd.replay_poll_s] != [2.0]
    assert slept_by_upstream_wait(mixin_trainer("opd.replay_poll_s=0.3"), monkeypatch) == [0.3]
    # a config without the key (one composed before it existed) polls as the recipes do, not every 2 s
    without = mixin_trainer(drop=["replay_poll_s"])
    assert slept_by_upstream_wait(without, monkeypatch) == [recipe.config.opd.replay_poll_s]
    for bad in ("0", "-1", "true", "fast"):
        with pytest.raises(ValueError, match="opd.replay_poll_s"):
            mixin_trainer(f"opd.replay_poll_s={bad}")
