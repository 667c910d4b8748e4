"""Trainer mode `colocated_teacher` (`trainer.v1.trainer_mode=colocated_teacher`).

Upstream's synchronous V1 trainer, with the teacher moved onto the actor's GPUs:
- the actor role's worker class is `ColocatedTeacherWorker` (upstream's worker + a forward-only teacher);
- no teacher resource pool, no `MultiTeacherModelManager`, no teacher client: `use_teacher_policy` is
  off while `distillation.enabled` stays on, so upstream's distillation losses and update flags apply;
- the agent loop calls no teacher server (agent_loop.py);
- every sampled batch is scored by the teacher (`teacher_logprobs`, `teacher_ids` into TransferQueue)
  right before old_log_prob, i.e. after rollout (the rollout replicas are asleep) and before the update;
  its time is logged as `timing_s/teacher` and is also part of `timing_s/old_log_prob`.

Settings, under `trainer.v1.colocated_teacher` (upstream's place for per-mode settings):
  offload (true)            park the teacher in host memory between steps
  chunk_size (2048)         positions per lm_head/log_softmax chunk
  max_token_len (null)      padded tokens per teacher forward; null: rollout.log_prob_max_token_len_per_gpu
  canary_every (1)          rescan the teacher canary (canary.py) every N scoring calls; 0: start-up check only
  old_log_prob (compute)    the student's old-log-prob pass: compute | skip | from_update, resolved from
                            `opd.skip_old_log_prob` by opd_patches.main (old_log_prob.py says when each holds)
"""

import dataclasses
import time

import ray
from omegaconf import DictConfig, open_dict

# VERL imports this module (VERL_USE_EXTERNAL_MODULES) possibly while `opd_patches` itself is still
# importing; VERL's trainer imports its engines, which resolve the platform at import time, so the
# `cpu` platform must be registered first.
from opd_patches.platforms import cpu as cpu_platform  # noqa: F401, I001
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.debug import marked_timer
from verl.utils.import_utils import load_class_from_fqn

from opd_patches.hooks import profile_update
from opd_patches.trainers.opd_sync import OpsTrainerMixin
# Not imported here: opd_patches.teacher.agent_loop. It defines the agent-loop worker, an actor class that a Ray
# process may import first, and `import verl` there imports this module (VERL_USE_EXTERNAL_MODULES) while that
# one is half-initialised; so this module imports it where it is used.
AGENT_LOOP_MANAGER_FQN = "opd_patches.teacher.agent_loop.ColocatedTeacherAgentLoopManager"
from opd_patches.teacher import old_log_prob
from opd_patches.teacher.worker import ColocatedTeacherWorker

NAME = "colocated_teacher"
ACTOR_ROLES = (Role.ActorRollout, Role.ActorRolloutRef, Role.Actor)


@register_trainer(NAME)
class ColocatedTeacherTrainer(OpsTrainerMixin, PPOTrainerSync):
    """PPOTrainerSync whose actor workers also score each batch with the teacher; no teacher pool or server.

    OpsTrainerMixin (opd_patches/trainers/opd_sync.py) adds the wall clock, receipts, pruning, resume from
    complete states and the non-finite guard, as for the standalone teacher's `opd_sync` mode."""

    # Upstream keys its sync-vs-async behaviour (replay buffer, refills, TransferQueue checkpoints) on
    # `trainer_mode == "sync"`; this mode is sync, so it answers "sync" whatever the config's name is.
    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        pass  # upstream's __init__ assigns the configured name; this mode always answers "sync"

    def __init__(self, config: DictConfig):
        if not config.get("distillation", {}).get("enabled", False):
            raise ValueError(f"trainer.v1.trainer_mode={NAME} needs distillation.enabled=true")
        from opd_patches.teacher.agent_loop import ColocatedTeacherAgentLoopManager

        agent = config.actor_rollout_ref.rollout.agent
        manager = agent.get("agent_loop_manager_class")
        if manager is None:
            with open_dict(config):
                agent.agent_loop_manager_class = AGENT_LOOP_MANAGER_FQN
        elif not issubclass(load_class_from_fqn(manager, "AgentLoopManager"), ColocatedTeacherAgentLoopManager):
            raise ValueError(
                f"actor_rollout_ref.rollout.agent.agent_loop_manager_class={manager} would call a teacher server; "
                f"with trainer.v1.trainer_mode={NAME} use {AGENT_LOOP_MANAGER_FQN} or a subclass"
            )
        super().__init__(config)
        self.use_teacher_policy = False  # upstream: teacher servers on their own pool; here: none
        self.teacher_settings = dict(config.trainer.v1.get(NAME, None) or {})
        self.old_log_prob_mode = self.teacher_settings.get("old_log_prob") or old_log_prob.COMPUTE
        if self.old_log_prob_mode not in old_log_prob.MODES:
            raise ValueError(f"trainer.v1.{NAME}.old_log_prob={self.old_log_prob_mode}: one of {old_log_prob.MODES}")

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        self.resource_pool_manager.resource_pool_spec.pop("teacher_pool", None)
        self.mapping.pop(Role.TeacherModel, None)
        for role in ACTOR_ROLES:
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(ColocatedTeacherWorker)

    def _setup(self):
        super()._setup()
        # Upstream sets this only beside a teacher pool; the actor update reads it for the loss flags.
        self.distillation_config = omega_conf_to_dataclass(self.config.distillation)
        s = self.teacher_settings
        self.actor_rollout_wg.init_colocated_teacher(
            offload=bool(s.get("offload", True)),
            chunk_size=int(s.get("chunk_size") or 2048),
            max_token_len=s.get("max_token_len"),
            canary_every=int(1 if s.get("canary_every") is None else s["canary_every"]),
        )

    def get_llm_client(self):
        """One rollout replica (the single-GPU case): a client without the load balancer's round trips."""
        from opd_patches.teacher.agent_loop import SingleServerClient

        manager = self.llm_server_manager
        if len(manager.server_handles) == 1:
            return SingleServerClient(self.config, manager.server_addresses[0], manager.server_handles[0])
        return super().get_llm_client()

    def _compute_old_log_prob(self, batch, metrics):
        with marked_timer("teacher", self.timing_raw, color="purple"):
            self._compute_teacher_logprobs(batch)
        if self.old_log_prob_mode == old_log_prob.COMPUTE:
            return super()._compute_old_log_prob(batch, metrics)
        return batch  # no student pass: no loss reads old log-probs, or the update supplies its own

    def _update_actor(self, batch, metrics):
        if self.old_log_prob_mode != old_log_prob.COMPUTE:
            actor = self.config.actor_rollout_ref.actor
            if self.old_log_prob_mode == old_log_prob.FROM_UPDATE:
                # old = current holds only at the first optimizer step on this batch: it must be the only one.
                per_update = actor.ppo_mini_batch_size * self.config.actor_rollout_ref.rollout.n
                if actor.ppo_epochs != 1 or len(batch) > per_update:
                    raise RuntimeError(
                        f"opd.skip_old_log_prob: {len(batch)} samples, {actor.ppo_epochs} epoch(s) of mini-batches of "
                        f"{per_update}: more than one update, old log-probs cannot come from the update")
            batch.extra_info.update({
                old_log_prob.UPDATE_FLAG: self.old_log_prob_mode == old_log_prob.FROM_UPDATE,
                old_log_prob.ENTROPY_FLAG: True,  # actor.calculate_entropy is on (old_log_prob.apply)
            })
        start = time.time()
        out = super()._update_actor(batch, metrics)
        if profile_update.requested():  # opd.debug.profile_update: stamps beside the worker's (bench only)
            print(f"[opd] profile_update: trainer update_actor {start:.3f} -> {time.time():.3f}", flush=True)
        return out

    def _compute_teacher_logprobs(self, batch):
        """Score the batch's samples (all of them, balance padding included) into TransferQueue."""
        meta = dataclasses.replace(batch, fields=["input_ids"], extra_info={})
        output = self.actor_rollout_wg.compute_teacher_logprobs(meta)
        assert len(output) == len(batch), (len(output), len(batch))
