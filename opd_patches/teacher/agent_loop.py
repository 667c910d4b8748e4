"""Agent loop for the colocated teacher: upstream's, minus the call to a teacher server, minus two Ray
round trips per sample.

With `distillation.enabled`, every upstream agent-loop worker scores each finished sample through a
teacher server client (`AgentLoopWorker._compute_teacher_logprobs`) and fails at start-up without
one. Under the colocated teacher there is no server: the trainer scores the batch inside the actor's
worker group instead. Selected by `actor_rollout_ref.rollout.agent.agent_loop_manager_class` (the
`colocated_teacher` trainer mode sets it).

Per sample, upstream's worker also makes a Ray call to a reward-loop worker (`_compute_score`) and two to
the global load balancer (acquire, release) around the call to the rollout server. On a small CPU host
these round trips are a large share of a learning step's generation time (docs/learning.md), so:
- `InProcessRewardWorker`: a rule-based reward (no reward model) is computed by upstream's own
  `RewardLoopWorker` instantiated inside the agent-loop worker, called through the same
  `handle.compute_score.remote(data)` expression upstream uses;
- `SingleServerClient`: with one rollout replica there is nothing to balance; the client talks to that
  server directly (the trainer mode hands it out, `ColocatedTeacherTrainer.get_llm_client`).
Neither changes what is computed: the same reward manager and the same server `generate` call.
"""

import copy

from omegaconf import DictConfig, open_dict
from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ
from verl.workers.rollout.llm_server import LLMServerClient

import ray


def without_teacher_server(config: DictConfig) -> DictConfig:
    """A copy of the config whose agent-loop workers see distillation as disabled."""
    config = copy.deepcopy(config)
    with open_dict(config):
        config.distillation.enabled = False
    return config


def rule_based_reward(config: DictConfig) -> bool:
    """No reward model: the reward is a function of the decoded response (upstream's reward manager)."""
    return not config.reward.reward_model.enable


class _Method:
    """`obj.method.remote(*a)` for a plain object's coroutine method: the call expression of a Ray handle."""

    def __init__(self, fn):
        self.remote = fn


class InProcessRewardWorker:
    """Upstream's RewardLoopWorker in the caller's process, answering `compute_score.remote(data)`."""

    def __init__(self, config: DictConfig):
        self.config, self.worker = config, None
        self.compute_score = _Method(self._compute_score)

    async def _compute_score(self, data):
        if self.worker is None:  # built inside the running loop: its reward manager keeps the current loop
            self.worker = RewardLoopWorker(self.config, None)
        return await self.worker.compute_score(data)


class ColocatedTeacherAgentLoopWorker(AgentLoopWorkerTQ.__ray_actor_class__):
    """AgentLoopWorkerTQ whose rule-based reward is computed in its own process (no Ray call per sample)."""

    def __init__(self, config, llm_client, teacher_client=None, reward_loop_worker_handles=None, *args, **kwargs):
        super().__init__(config, llm_client, teacher_client, reward_loop_worker_handles, *args, **kwargs)
        if self.reward_loop_worker_handles is not None and rule_based_reward(self.config):
            self.reward_loop_worker_handles = [InProcessRewardWorker(self.config)]


class SingleServerClient(LLMServerClient):
    """LLMServerClient for exactly one rollout server: no load balancer round trips per request."""

    def __init__(self, config: DictConfig, server_id: str, server: ray.actor.ActorHandle):
        super().__init__(config=config, load_balancer_handle=None)
        self._server = (server_id, server)

    async def _acquire_server(self, request_id: str, **extra):
        return self._server

    def _release_server(self, server_id: str, request_id: str | None = None) -> None:
        pass


class ColocatedTeacherAgentLoopManager(AgentLoopManagerTQ):
    """AgentLoopManagerTQ whose workers get a config with distillation off, so they call no teacher server,
    and compute a rule-based reward in process."""

    def __init__(self, config: DictConfig, llm_client, teacher_client=None, reward_loop_worker_handles=None):
        super().__init__(without_teacher_server(config), llm_client, None, reward_loop_worker_handles)
        self.agent_loop_workers_class = ray.remote(ColocatedTeacherAgentLoopWorker)
