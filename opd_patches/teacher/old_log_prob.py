"""`opd.skip_old_log_prob`: which student log-prob pass a step runs before the update (auto | true | false).

Upstream's V1 trainer runs a full student forward over every sample before the update
(`_compute_old_log_prob`) to get `old_log_probs`. Its readers (verl 0.9.1): the PPO ratio of the
distillation policy gradient (`k1`, trainer/distillation/losses.py) and of the task-reward loss
(workers/utils/losses.py `ppo_loss`), the KL-in-reward penalty, the optimal-token-baseline
advantages, rollout correction (trainer_base `_compute_advantage`) and two metrics: `actor/entropy`
and the rollout-vs-actor log-prob diffs. The resolved mode:

  skip         no loss reads old log-probs (pure forward KL: no policy gradient, no task rewards):
               the pass is not run and nothing replaces it.
  from_update  the loss reads them, but each batch gets exactly one optimizer step (ppo_epochs 1, one
               mini-batch): old = the current policy at that step, so the update forward's own
               log-probs, detached, are the old ones (PPO ratio exactly 1; not the rollout's log-probs
               of rollout_correction.bypass_mode, which would change k1's ratio and losses).
  compute      upstream's pass.

auto = skip or from_update wherever the result is provably the same, compute elsewhere; true = the
same, refused (ConfigError naming the key) where it would change a loss or a reader would lose its
input; false = compute. With either skipping mode the entropy comes from the update's forward
(detached: it is a metric, entropy_coeff is 0) as `actor/entropy`; metrics only the pass produced
(rollout_corr/*, training/rollout_probs_diff_*) are not logged.
"""

from omegaconf import DictConfig, OmegaConf

from opd_patches import config as opd_config

COMPUTE, SKIP, FROM_UPDATE = "compute", "skip", "from_update"
MODES = (COMPUTE, SKIP, FROM_UPDATE)
KEY = "opd.skip_old_log_prob"
# Non-tensor key the trainer adds to the update's batch in from_update mode (read by the loss patch).
UPDATE_FLAG = "opd_old_log_probs_from_update"
# Non-tensor key: the update computes the entropy only as a metric (detached), reported as actor/entropy.
ENTROPY_FLAG = "opd_entropy_metric"
# Advantage estimators of verl 0.9.1 that never read old_log_probs (the optimal-token-baseline ones do).
ADV_WITHOUT_OLD = {
    "gae", "grpo", "grpo_vectorized", "gdpo", "grpo_passk", "reinforce_plus_plus_baseline", "rloo",
    "rloo_vectorized", "opo", "reinforce_plus_plus", "remax", "gpg",
}


def _blockers(config: DictConfig) -> list[str]:
    """Readers of old_log_probs outside the loss, or settings this mode does not cover."""
    out = []
    if opd_config.of(config).teacher_placement != "colocated":
        out.append("opd.teacher_placement is not colocated (only the colocated_teacher trainer mode implements it)")
    if OmegaConf.select(config, "algorithm.use_kl_in_reward", default=False):
        out.append("algorithm.use_kl_in_reward=true (the reward KL penalty reads old_log_probs)")
    adv = str(OmegaConf.select(config, "algorithm.adv_estimator"))
    if adv not in ADV_WITHOUT_OLD:
        out.append(f"algorithm.adv_estimator={adv} (may read old_log_probs)")
    rc = OmegaConf.select(config, "algorithm.rollout_correction")
    if rc is not None:
        if rc.get("bypass_mode", False):
            out.append("algorithm.rollout_correction.bypass_mode=true (already no student pass: old = rollout log-probs)")
        for key in ("rollout_is", "rollout_rs"):
            if rc.get(key) is not None:
                out.append(f"algorithm.rollout_correction.{key}={rc.get(key)} (its weights/mask read old_log_probs)")
    return out


def resolve(config: DictConfig) -> tuple[str, str]:
    """(mode, one-line reason) for this config; raises ValueError naming the key when `true` cannot hold."""
    value = opd_config.of(config).skip_old_log_prob  # auto | True | False, checked there
    if value is False:
        return COMPUTE, f"{KEY}=false"
    loss = config.distillation.distillation_loss
    readers = []
    if loss.get("use_policy_gradient", False):
        readers.append(f"distillation.distillation_loss.use_policy_gradient=true ({loss.loss_mode}'s PPO ratio)")
    if loss.get("use_task_rewards", False):
        readers.append("distillation.distillation_loss.use_task_rewards=true (the task-reward PPO loss)")
    blockers = _blockers(config)
    if readers:
        actor = config.actor_rollout_ref.actor
        epochs, mini = int(actor.ppo_epochs), int(actor.ppo_mini_batch_size)
        if epochs != 1 or mini < int(config.data.train_batch_size):
            blockers.append(
                f"{readers[0]} with more than one update per batch (actor.ppo_epochs={epochs}, "
                f"ppo_mini_batch_size={mini} < data.train_batch_size={config.data.train_batch_size}): "
                "old and current policies differ after the first")
    if blockers:
        if value is True:
            raise ValueError(f"{KEY}=true would change the run: {'; '.join(blockers)}. Use auto or false.")
        return COMPUTE, "auto: " + "; ".join(blockers)
    if readers:
        return FROM_UPDATE, (f"{readers[0]}, one update per batch: old log-probs = the update forward's own, "
                             "detached (ratio 1)")
    return SKIP, "no loss reads old log-probs (no policy gradient, no task rewards)"


def apply(config: DictConfig) -> str:
    """Resolve the key into the colocated trainer's settings and upstream keys; returns the line to print.

    Skipping: `trainer.v1.colocated_teacher.old_log_prob=<mode>` (the trainer reads it), upstream's
    `actor.calculate_entropy=true` (the update's entropy: the metric's new source) and
    `actor.entropy_from_logits_with_chunking=true`, and, where rollout correction only logs metrics
    (no rollout_is/rollout_rs), `algorithm.rollout_correction=null`: its metrics compare old_log_probs
    with the rollout's, and there are none."""
    from omegaconf import open_dict

    mode, reason = resolve(config)
    if opd_config.of(config).teacher_placement == "colocated":
        with open_dict(config):
            OmegaConf.update(config, "trainer.v1.colocated_teacher.old_log_prob", mode, force_add=True)
            if mode != COMPUTE:
                config.actor_rollout_ref.actor.calculate_entropy = True
                # In chunks of 2,048 rows: the whole micro-batch at once holds several (T, V) fp32 tensors
                # (~30 GB at 16k tokens x 152k vocabulary) on top of the update's activations.
                config.actor_rollout_ref.actor.entropy_from_logits_with_chunking = True
                config.algorithm.rollout_correction = None
    return describe(mode, reason)


def entropy_detached(config: DictConfig) -> bool:
    """The update computes the entropy only for the metric: its gradient would be multiplied by 0."""
    skipping = OmegaConf.select(config, "trainer.v1.colocated_teacher.old_log_prob", default=COMPUTE) != COMPUTE
    return skipping and float(config.actor_rollout_ref.actor.entropy_coeff) == 0.0


def describe(mode: str, reason: str) -> str:
    what = {
        COMPUTE: "the student's old-log-prob pass runs (upstream)",
        SKIP: "no student old-log-prob pass (the teacher still scores); actor/entropy from the update's forward",
        FROM_UPDATE: "no student old-log-prob pass; actor/entropy from the update's forward",
    }[mode]
    return f"[opd] old log-probs: {mode}: {what} [{reason}]"


# ---- worker side (reached through opd_patches/patches/distillation_ppo_loss.py) -----------------


def with_current_as_old(model_output: dict, data):
    """`data` with `old_log_probs` = this forward's sampled-token log-probs, detached, in the layout the
    trainer's pass writes (nested, one row per response, as trainer_base `_compute_old_log_prob`)."""
    from verl.workers.utils.padding import no_padding_2_padding, response_to_nested

    if "old_log_probs" in data.keys():
        raise RuntimeError(f"{UPDATE_FLAG}: the batch already has old_log_probs (the student pass ran)")
    padded = no_padding_2_padding(model_output["log_probs"], data).detach()
    data = data.copy()  # shallow: the engine's micro-batch keeps its own keys
    data["old_log_probs"] = response_to_nested(padded, data["response_mask"])
    return data


def entropy_metric(config, model_output: dict, data):
    """`actor/entropy` of this micro-batch's update forward, aggregated as upstream aggregates the pass's
    (agg_loss with the actor's loss_agg_mode over the global batch; the micro-batch parts add up)."""
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    entropy = no_padding_2_padding(model_output["entropy"], data).detach()
    mask = data["response_mask"]
    mask = (mask.to_padded_tensor(0) if mask.is_nested else mask).bool()
    value = agg_loss(
        loss_mat=entropy, loss_mask=mask, loss_agg_mode=config.loss_agg_mode,
        dp_size=data["dp_size"], batch_num_tokens=data["batch_num_tokens"],
        global_batch_size=data["global_batch_size"], loss_scale_factor=config.loss_scale_factor,
    )
    return Metric(value=value, aggregation=AggregationType.SUM)
