"""The task reward of every OPD recipe: `opd_patches.task.grader` for every data_source.

VERL 0.9.1's own `default_compute_score` dispatches on `data_source` and raises on a name it does not
know; this function grades every sample the same way, so a run never fails on its data_source.
Selected in a recipe through VERL's custom reward hook (`verl.trainer.ppo.reward.get_custom_reward_fn`):

    reward:
      custom_reward_function:
        path: pkg://opd_patches.task.reward   # an importable module; a file path works too
        name: compute_score
        reward_kwargs:
          tokenizer: ${actor_rollout_ref.model.path}   # whose chat template may open a thought

The reward loop's `naive` manager calls it in an executor thread with keyword arguments and keeps
the returned dict as `reward_extra_info` (`acc` and `pred` feed VERL's validation metrics, `pred`
its majority vote). Keys under `reward.custom_reward_function.reward_kwargs` (e.g. `timeout_s`) are
passed on as keyword arguments. `tokenizer` (a tokenizer or model folder) tells the grader whether the
generation prompt opened a thought (R1-Distill's template ends it with `<think>`), read once per
process from its chat template (`opd_patches.task.prompt.opens_thought`), as the evaluation reads it; without
it the prompt counts as opening none.
"""

from functools import lru_cache

from opd_patches.task.grader import DEFAULT_TIMEOUT_S, grade


@lru_cache(maxsize=None)
def prompt_opens_thought(tokenizer: str) -> bool:
    from transformers import AutoTokenizer

    from opd_patches.task.prompt import opens_thought

    try:
        loaded = AutoTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError) as exc:
        raise ValueError(f"reward.custom_reward_function.reward_kwargs.tokenizer={tokenizer!r}: no tokenizer loads from "
                         f"it ({exc}); point it at the policy's model or tokenizer folder") from exc
    return opens_thought(loaded)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, timeout_s=DEFAULT_TIMEOUT_S,
                  tokenizer=None, **kwargs):
    """{"score": 1.0 | 0.0, "acc": correct, "pred": extracted answer or "", "unfinished_thought"} for one response."""
    opened = bool(tokenizer) and prompt_opens_thought(str(tokenizer))
    result = grade(solution_str, ground_truth, timeout_s=timeout_s, prompt_opened_thought=opened)
    return {"score": float(result.correct), "acc": result.correct, "pred": result.extracted or "",
            "unfinished_thought": result.unfinished_thought}
