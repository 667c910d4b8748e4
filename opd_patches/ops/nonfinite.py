"""Non-finite guard: a NaN or infinite loss, gradient norm or teacher output stops the run at that step.

Checked quantities (metric names as VERL logs them, so the message names what a user sees in
metrics.jsonl): every `actor/*loss*` metric (`actor/loss`, `actor/pg_loss`,
`actor/distillation/loss`, ...), `actor/grad_norm`, any metric with `teacher` in its name, and the
teacher log-probs themselves (`teacher_logprobs`, read back before the update). The trainer checks
after the update and before any save, so the state of a poisoned step is never saved or exported.

Fault injection (TEST ONLY, `opd.debug.inject_nan_step=N`, `opd.debug.inject_nan_into=loss|teacher`):
at step N the trainer overwrites the teacher log-probs with NaN, either after the teacher check
(`loss`: the NaN flows through the real loss, so the loss/grad-norm check must catch it) or before it
(`teacher`: the teacher-output check must catch it, before the update runs).
"""

import math

import torch


class NonFiniteError(RuntimeError):
    """A watched quantity was NaN or infinite; `step` and `quantity` name it."""

    def __init__(self, step: int, quantity: str, value):
        self.step, self.quantity, self.value = int(step), quantity, value
        super().__init__(
            f"non-finite {quantity} ({value}) at step {step}: the run stops here; nothing of step {step} is "
            "saved, the newest complete state is the last good one."
        )


HEADLINE = ("actor/loss", "actor/grad_norm", "actor/distillation/loss", "actor/pg_loss")


def watched(name: str) -> bool:
    return name.startswith("actor/") and ("loss" in name or name == "actor/grad_norm") or "teacher" in name


def check_metrics(metrics: dict, step: int) -> None:
    """Raise NonFiniteError for the first watched metric that is not finite (the headline ones first)."""
    for name in sorted(metrics, key=lambda n: (n not in HEADLINE, HEADLINE.index(n) if n in HEADLINE else 0, n)):
        if not watched(name):
            continue
        value = metrics[name]
        if isinstance(value, torch.Tensor):
            value = value.float().mean().item() if value.numel() else 0.0
        if isinstance(value, (int, float)) and not math.isfinite(value):
            raise NonFiniteError(step, name, value)


def check_tensor(values, step: int, quantity: str) -> None:
    """Raise NonFiniteError when a tensor (dense or nested/jagged) holds a NaN or an infinity."""
    flat = values.values() if getattr(values, "is_nested", False) else values
    flat = flat.float()
    if flat.numel() and not torch.isfinite(flat).all():
        bad = flat[~torch.isfinite(flat)]
        raise NonFiniteError(step, quantity, f"{bad.numel()} of {flat.numel()} values, e.g. {bad[0].item()}")
