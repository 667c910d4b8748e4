"""The task reward of every OPD recipe: `opd_patches.grader` for every data_source.

VERL 0.9.1's own `default_compute_score` dispatches on `data_source` and raises on a name it does not
know; this function grades every sample the same way, so a run never fails on its data_source.
Selected in a recipe through VERL's custom reward hook (`verl.trainer.ppo.reward.get_custom_reward_fn`):

    reward:
      custom_reward_function:
        path: pkg://opd_patches.reward   # an importable module; a file path works too
        name: compute_score

The reward loop's `naive` manager calls it in an executor thread with keyword arguments and keeps
the returned dict as `reward_extra_info` (`acc` and `pred` feed VERL's validation metrics, `pred`
its majority vote). Keys under `reward.custom_reward_function.reward_kwargs` (e.g. `timeout_s`) are
passed on as keyword arguments.
"""

from opd_patches.grader import DEFAULT_TIMEOUT_S, grade


def compute_score(data_source, solution_str, ground_truth, extra_info=None, timeout_s=DEFAULT_TIMEOUT_S, **kwargs):
    """{"score": 1.0 | 0.0, "acc": correct, "pred": extracted answer or ""} for one response."""
    result = grade(solution_str, ground_truth, timeout_s=timeout_s)
    return {"score": float(result.correct), "acc": result.correct, "pred": result.extracted or ""}
