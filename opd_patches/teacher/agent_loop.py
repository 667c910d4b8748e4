"""Agent loop for the colocated teacher: upstream's, minus the call to a teacher server.

With `distillation.enabled`, every upstream agent-loop worker scores each finished sample through a
teacher server client (`AgentLoopWorker._compute_teacher_logprobs`) and fails at start-up without
one. Under the colocated teacher there is no server: the trainer scores the batch inside the actor's
worker group instead. Selected by `actor_rollout_ref.rollout.agent.agent_loop_manager_class` (the
`colocated_teacher` trainer mode sets it).
"""

import copy

from omegaconf import DictConfig, open_dict
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

FQN = "opd_patches.teacher.agent_loop.ColocatedTeacherAgentLoopManager"


def without_teacher_server(config: DictConfig) -> DictConfig:
    """A copy of the config whose agent-loop workers see distillation as disabled."""
    config = copy.deepcopy(config)
    with open_dict(config):
        config.distillation.enabled = False
    return config


class ColocatedTeacherAgentLoopManager(AgentLoopManagerTQ):
    """AgentLoopManagerTQ whose workers get a config with distillation off, so they call no teacher server."""

    def __init__(self, config: DictConfig, llm_client, teacher_client=None, reward_loop_worker_handles=None):
        super().__init__(without_teacher_server(config), llm_client, None, reward_loop_worker_handles)
