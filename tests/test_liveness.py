"""opd_patches/ops/liveness.py: a dead rollout-side actor stops the trainer's wait for samples.

The guards fail loudly when upstream moves what the check hooks into or reads; the behaviour is checked on
real Ray actors (one killed, one alive but busy) in a fresh process with its own small Ray instance."""

import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import types

import pytest
from verl.experimental.agent_loop import AgentLoopManager
from verl.trainer.ppo.v1 import replay_buffer, trainer_base
from verl.workers.rollout.llm_server import LLMServerManager

import opd_patches  # noqa: F401

from opd_patches.config import OpdConfig
from opd_patches.ops import liveness
from test_replay_poll import mixin_trainer


def test_upstream_still_polls_through_the_wrapped_method():
    wait = replay_buffer.ReplayBuffer._wait_for_next_poll
    assert list(inspect.signature(wait).parameters) == ["self", "partition_id", "last_debug_time"]
    # both sample() loops (sync and async buffers) wait there, without a deadline of their own
    assert inspect.getsource(replay_buffer).count("self._wait_for_next_poll(partition_id, last_debug_time)") == 2


def test_upstream_still_holds_the_handles_where_we_read_them():
    assert "self.agent_loop_manager = agent_loop_manager" in inspect.getsource(trainer_base.PPOTrainer.fit)
    assert "self.agent_loop_workers = []" in inspect.getsource(AgentLoopManager)
    assert "self.server_handles = [server._server_handle" in inspect.getsource(LLMServerManager)
    from verl.experimental.reward_loop import RewardLoopManager

    assert "self.reward_loop_workers" in inspect.getsource(RewardLoopManager)


class _Clock:
    """liveness's monotonic clock, moved by the test."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now


@pytest.mark.parametrize("overrides, drop, every_s", [(["opd.liveness_check_s=5"], [], 5.0),
                                                      ([], ["liveness_check_s"], OpdConfig().liveness_check_s)])
def test_the_mixin_installs_it_from_the_recipe_key(monkeypatch, overrides, drop, every_s):
    """The trainer's poll asks Ray about the trainer's own rollout actors once `opd.liveness_check_s` seconds of
    waiting have passed (the default for a config without the key), and raises when one is dead."""
    clock, asked, verdicts = _Clock(), [], [[], ["agent-loop worker 0"]]
    monkeypatch.setattr(liveness, "time", clock)
    monkeypatch.setattr(liveness, "dead", lambda actors: asked.append(dict(actors)) or verdicts[len(asked) - 1])
    trainer = mixin_trainer(*overrides, drop=drop)
    monkeypatch.setattr(replay_buffer, "time", types.SimpleNamespace(sleep=lambda s: None, time=time.time))
    # upstream's fit assigns the managers after __init__: the check reads them when it runs
    trainer.llm_server_manager = types.SimpleNamespace(server_handles=["server"])
    trainer.agent_loop_manager = types.SimpleNamespace(agent_loop_workers=["worker"])
    wait = trainer.replay_buffer._wait_for_next_poll
    actors = {"rollout server 0": "server", "agent-loop worker 0": "worker"}
    last = time.time()  # upstream's last debug log: recent, so its wait returns it unchanged

    clock.now = every_s - 0.01
    assert wait("train", last) == last and asked == []  # the wrapped wait's own return value passes through
    clock.now = every_s
    assert wait("train", last) == last and asked == [actors]  # all alive: waiting goes on
    clock.now = 2 * every_s - 0.01
    wait("train", last)
    assert len(asked) == 1  # the next check is every_s after the last one
    clock.now = 2 * every_s
    with pytest.raises(liveness.RolloutActorDied, match=r"^\[opd\] agent-loop worker 0 died"):
        wait("train", last)
    assert asked == [actors, actors]


_SCRIPT = textwrap.dedent(
    """
    import json, time, ray
    from types import SimpleNamespace
    from opd_patches.ops import liveness

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Server:
        def busy(self, s):
            time.sleep(s)

    class Buffer:  # the one method upstream's sample() loops call between looks at TransferQueue
        polls = 0
        def _wait_for_next_poll(self, partition_id, last_debug_time):
            self.polls += 1
            return last_debug_time

    server, worker = Server.remote(), Server.remote()
    trainer = SimpleNamespace(llm_server_manager=SimpleNamespace(server_handles=[server]),
                              agent_loop_manager=SimpleNamespace(agent_loop_workers=[worker]))
    out = {"actors": sorted(liveness.rollout_actors(trainer))}
    buffer = Buffer()
    liveness.install(buffer, lambda: liveness.rollout_actors(trainer), every_s=0.0)
    out["alive"] = buffer._wait_for_next_poll("train", 1.5)

    server.busy.remote(60)  # a synchronous actor inside a long call: no answer, not dead
    out["busy"] = liveness.dead(liveness.rollout_actors(trainer), timeout_s=1.0)

    ray.kill(worker)
    time.sleep(1.0)
    try:
        buffer._wait_for_next_poll("train", 2.5)
        out["error"] = None
    except liveness.RolloutActorDied as exc:
        out["error"] = str(exc)
    out["polls"] = buffer.polls
    print(json.dumps(out), flush=True)
    ray.shutdown()
    """
)


@pytest.mark.fresh_process
def test_a_killed_actor_stops_the_wait_a_busy_one_does_not():
    # Ray's socket paths must stay under 107 bytes: a short folder of its own, not pytest's tmp_path
    with tempfile.TemporaryDirectory(prefix="opd-ray-", dir="/tmp") as ray_tmp:
        proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "RAY_TMPDIR": ray_tmp})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["actors"] == ["agent-loop worker 0", "rollout server 0"]
    assert out["alive"] == 1.5  # the wrapped poll's own return value passes through
    assert out["busy"] == []
    assert out["error"] is not None and out["error"].startswith("[opd] agent-loop worker 0 died")
    assert "rollout server" not in out["error"] and out["polls"] == 2
