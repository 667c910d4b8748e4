"""Wall-clock budget: when must the trainer stop so that its last step is saved and exported?

Conventions: `launched_at` is the epoch time the launcher started (opd_patches.main records it),
so Ray start-up and model loading count against the clock, as they do for a harness. Training must
be over, the final state saved, exported and validated, by `launched_at + wall_clock_s - reserve_s`;
the reserve is left for whatever runs after the trainer (e.g. evaluation of the exports).

After every step the trainer asks `should_stop()`: stop now when
    now + margin * (next step + its save) > deadline,
with `next step` the largest of the last few measured step times (rollout, update, weight sync; the
save excluded) and `its save` the largest measured whole save: what the trainer waited plus, with
background saves (finish.py), the export validation, hashing and receipt that ran beside training,
because the last save waits for all of it; before any save was measured the step time stands in for
it. A background finish still running adds what is left of it (its expected length minus its age). Stopping "now" means the
step just finished is saved (if the regular schedule did not save it) and the loop ends: the last
steps are never lost to the clock. When a step overruns the deadline (the clock ran out mid-step),
the same rule stops right after it; the reserve absorbs that step's save.
"""

import time
from collections import deque
from dataclasses import dataclass, field

RECENT = 5


@dataclass
class WallClock:
    wall_clock_s: float | None
    reserve_s: float = 0.0
    margin: float = 1.5
    launched_at: float = field(default_factory=time.time)
    clock: object = time.time  # injectable for tests
    steps: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    saves: deque = field(default_factory=lambda: deque(maxlen=RECENT))

    def __post_init__(self):
        if self.wall_clock_s is not None and self.wall_clock_s <= 0:
            raise ValueError(f"opd.wall_clock_s={self.wall_clock_s}: must be positive seconds, or null for no limit.")
        if self.reserve_s < 0 or self.margin < 1:
            raise ValueError(f"opd.reserve_s={self.reserve_s} must be >= 0 and opd.wall_clock_margin={self.margin} >= 1.")

    @property
    def enabled(self) -> bool:
        return self.wall_clock_s is not None

    @property
    def deadline(self) -> float:
        return self.launched_at + self.wall_clock_s - self.reserve_s

    def remaining(self) -> float:
        return self.deadline - self.clock() if self.enabled else float("inf")

    def record_step(self, seconds: float) -> None:
        self.steps.append(float(seconds))

    def record_save(self, seconds: float) -> None:
        """A whole save: the trainer's wait plus its background finish (the final save waits for both)."""
        self.saves.append(float(seconds))

    def predicted(self) -> float:
        """Seconds the next step plus its save is expected to take, margin included."""
        step = max(self.steps) if self.steps else 0.0
        save = max(self.saves) if self.saves else step
        return self.margin * (step + save)

    def should_stop(self, pending_save: bool = False, in_flight_s: float | None = None) -> tuple[bool, str]:
        """(stop, why): checked after a finished step; pending_save: the schedule saves this step first;
        in_flight_s: age of a background finish still running (None: none)."""
        if not self.enabled:
            return False, ""
        left, need = self.remaining(), self.predicted()
        one_save = max(self.saves) if self.saves else max(self.steps, default=0.0)
        if pending_save:
            need += self.margin * one_save
        if in_flight_s is not None:
            need += self.margin * max(0.0, one_save - in_flight_s)
        if left < need:
            over = " (the deadline has passed)" if left < 0 else ""
            return True, (
                f"wall clock: {left:.0f} s left before the reserve{over}, the next step and its save need "
                f"~{need:.0f} s (wall_clock_s={self.wall_clock_s:g}, reserve_s={self.reserve_s:g}, margin={self.margin:g})"
            )
        return False, ""

    def exhausted_before_start(self) -> tuple[bool, str]:
        """(stop, why) before a process's first step: nothing measured, so only a spent clock stops."""
        if self.enabled and self.remaining() <= 0:
            return True, f"wall clock spent before the first step of this process ({-self.remaining():.0f} s past the reserve)"
        return False, ""
