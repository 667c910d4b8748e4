"""The teacher canary: a fixed sequence scored at start-up and rescanned while training.

Sleep/offload bugs can leave a teacher without its weights (zeroed, freed, never reloaded) and such a
teacher silently outputs a uniform distribution; distillation against it trains on noise. The canary
scores one fixed sequence (`score_sequences(model, [seq], k=0)`: the log-prob of every next token)
when the teacher is loaded, keeps the result, and on every `check` rescans the same sequence and raises
`TeacherCanaryError` when:
- a log-prob is not finite (NaN/inf weights or activations);
- the mean log-prob is within `uniform_margin` of -log V (near-uniform; zero weights give exactly
  -log V, whatever the dtype, since the logits are then all 0) - also checked at start-up, so a
  teacher loaded without weights is refused before it scores anything;
- a log-prob moved from the start-up reference by more than `tolerance` (weights drifted or were
  only partly restored).

Defaults:
- `tolerance`: 1e-3 nats in float32 (the same sequence on the same device is reproduced bitwise in
  practice; the slack covers kernel/algorithm choices), 5e-2 nats in bf16/fp16 (a half-precision
  teacher's log-probs carry ~1e-2 of rounding noise, so only kernel-choice differences must not trip
  it; a real weight loss or perturbation moves them by far more).
- `uniform_margin`: 1e-3 nats. Zero weights land within ~1e-6 of -log V; the embedded tiny teacher,
  freshly initialised and itself nearly uniform, sits ~3e-2 nats below it, and trained teachers
  several nats below, so 1e-3 refuses weightless teachers without refusing the smoke runs'.
"""

import math
from typing import Optional

import torch

from opd_patches.teacher.scoring import score_sequences

CANARY_TEXT = (
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether? Answer: 48 + 48 / 2 = 72, so \\boxed{72}."
)
CANARY_LENGTH = 64  # tokens at most


class TeacherCanaryError(RuntimeError):
    """The teacher no longer scores its canary sequence as it did at start-up."""


def canary_sequence(vocab_size: int, tokenizer=None, length: int = CANARY_LENGTH) -> torch.Tensor:
    """The fixed canary: `CANARY_TEXT` in the teacher's tokenizer, else fixed pseudo-random ids (seed 0)."""
    if tokenizer is not None:
        ids = [i for i in tokenizer(CANARY_TEXT)["input_ids"] if 0 <= i < vocab_size][:length]
        if len(ids) >= 8:
            return torch.tensor(ids, dtype=torch.long)
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(0))


def default_tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2


class TeacherCanary:
    """Reference log-probs of a fixed sequence, taken at start-up; `check` compares a rescan with them."""

    def __init__(
        self,
        model,
        sequence: Optional[torch.Tensor] = None,
        *,
        tokenizer=None,
        tolerance: Optional[float] = None,
        uniform_margin: float = 1e-3,
    ):
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.log_v = math.log(self.vocab_size)
        self.sequence = sequence if sequence is not None else canary_sequence(self.vocab_size, tokenizer)
        dtype = next(model.parameters()).dtype
        self.tolerance = default_tolerance(dtype) if tolerance is None else float(tolerance)
        self.uniform_margin = float(uniform_margin)
        self.reference = self.scan(model)
        self._sane(self.reference, "at start-up")
        self.reference_mean = float(self.reference.mean())

    def scan(self, model) -> torch.Tensor:
        """Log-prob of each next token of the canary (the dummy last row dropped), float32 on the CPU."""
        (lp,), _ = score_sequences(model, [self.sequence], 0)
        return lp[:-1, 0]

    def _sane(self, lp: torch.Tensor, when: str) -> None:
        if not torch.isfinite(lp).all():
            bad = int((~torch.isfinite(lp)).sum())
            raise TeacherCanaryError(
                f"teacher canary {when}: {bad} of {lp.numel()} log-probs are not finite (NaN/inf); the "
                "teacher's weights or activations are corrupt, so its scores cannot be used."
            )
        mean = float(lp.mean())
        if abs(mean + self.log_v) <= self.uniform_margin:
            raise TeacherCanaryError(
                f"teacher canary {when}: mean log-prob {mean:.6f} is within {self.uniform_margin:g} of "
                f"-log V = {-self.log_v:.6f} (V = {self.vocab_size}): the teacher outputs a near-uniform "
                "distribution, i.e. it has no (or zeroed) weights - e.g. loaded without its checkpoint, or "
                "not restored after offload/sleep. Distilling from it would train on noise."
            )

    def check(self, model) -> float:
        """Rescan; raise TeacherCanaryError if the teacher broke or drifted. Returns the max abs difference."""
        lp = self.scan(model)
        self._sane(lp, "rescan")
        diff = float((lp - self.reference).abs().max())
        if diff > self.tolerance:
            raise TeacherCanaryError(
                f"teacher canary rescan: log-probs of the fixed canary sequence moved by up to {diff:.6g} nats "
                f"from the start-up reference (tolerance {self.tolerance:g}; mean {float(lp.mean()):.6f}, was "
                f"{self.reference_mean:.6f}): the teacher's weights changed since it was loaded (drift, a "
                "partial onload, or another model's weights written into it)."
            )
        return diff
