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

import pytest
from verl.experimental.agent_loop import AgentLoopManager
from verl.trainer.ppo.v1 import replay_buffer, trainer_base
from verl.workers.rollout.llm_server import LLMServerManager

import opd_patches  # noqa: F401

from opd_patches.ops import trainer as ops_trainer


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


def test_the_mixin_installs_it_from_the_recipe_key():
    src = inspect.getsource(ops_trainer.OpsTrainerMixin.__init__)
    assert 'opd.get("liveness_check_s", liveness.DEFAULT_EVERY_S)' in src
    assert "liveness.install(self.replay_buffer, lambda: liveness.rollout_actors(self)" in src


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
