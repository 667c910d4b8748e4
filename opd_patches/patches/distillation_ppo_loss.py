"""Changes `verl.workers.engine_workers.distillation_ppo_loss` (the module-global name that
`ActorRolloutRefWorker.init_model` binds into the actor's loss function, workers/engine_workers.py:639 in
VERL 0.9.1; the function is verl.trainer.distillation.losses.distillation_ppo_loss).

Why: old log-probs from the update (`opd.skip_old_log_prob`, teacher/old_log_prob.py). VERL 0.9.1 has no
on-policy branch (old = current, detached, when one epoch and one mini-batch). When the trainer marks the
update batch, the wrapped loss gets `old_log_probs` = the forward's own log-probs, detached, and, when
asked, the forward's entropy as the `actor/entropy` metric. Only that one name is replaced: the logits
processor's call (with `student_logits`) and every other binding run upstream's function unchanged.
Accepts: upstream's calls (dp_group, student_logits and data_format by keyword, as its callers pass them).
"""

import functools

from opd_patches.patches import registry
from opd_patches.patches.registry import Upstream

CHANGES = (Upstream("verl.workers.engine_workers", "distillation_ppo_loss",
                    params=("config", "distillation_config", "model_output", "data", "dp_group", "student_logits",
                            "data_format")),)
RELIES_ON = (
    # init_model binds the module-level name (the wrapper) into the actor's loss function
    Upstream("verl.workers.engine_workers", "ActorRolloutRefWorker.init_model",
             source=("partial(\n                    distillation_ppo_loss,",)),
    # the readers of old_log_probs the wrapper feeds
    Upstream("verl.trainer.distillation.losses", "distillation_loss", source=('data["old_log_probs"]',)),
    Upstream("verl.workers.utils.losses", "ppo_loss", source=('"old_log_probs"',)),
)


def _wrap(original):
    from verl.utils import tensordict_utils as tu

    from opd_patches.teacher import old_log_prob

    @functools.wraps(original)
    def distillation_ppo_loss(config, distillation_config, model_output=None, data=None, **kwargs):
        if kwargs.get("student_logits") is not None or data is None:  # the logits processor: unchanged
            return original(config, distillation_config, model_output=model_output, data=data, **kwargs)
        if tu.get_non_tensor_data(data=data, key=old_log_prob.UPDATE_FLAG, default=False):
            data = old_log_prob.with_current_as_old(model_output, data)
        loss, metrics = original(config, distillation_config, model_output=model_output, data=data, **kwargs)
        if tu.get_non_tensor_data(data=data, key=old_log_prob.ENTROPY_FLAG, default=False):
            metrics["actor/entropy"] = old_log_prob.entropy_metric(config, model_output, data)
        return loss, metrics

    return distillation_ppo_loss


def apply():
    import verl.workers.engine_workers as workers

    return registry.apply(__name__, workers, "distillation_ppo_loss", _wrap)
