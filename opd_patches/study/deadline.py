"""The deadline arithmetic of `make run` (study/chain.py): when training must stop so that checkpoint
selection and the final score fit before the deadline.

- The deadline is fixed once, at the chain's first launch (`--deadline`: an absolute time; `--wall-clock`:
  seconds from that launch) and stored in `<out>/chain.json`; every later launch (after a crash or a kill)
  works toward the same one (`fix_deadline`).
- What runs after training (`after_training`): selection evaluates every kept export on the proxy suite
  (at most trainer.max_actor_ckpt_to_keep validated states plus the newest complete one: ops/checkpoints.py)
  and the student there; the final score evaluates the choice and the student on the final suite. Each
  evaluation costs questions x samples x max_new_tokens tokens (every sample at the cap) over a throughput,
  plus a start-up (process, model load).
- Throughput (`throughput`): measured, generated tokens over elapsed seconds of an earlier evaluation of this
  chain or of the student's cached ones (the slowest found); else a conservative default for the device.
- Training then gets opd.wall_clock_s = deadline - its launch time and opd.reserve_s = that estimate
  (`training_window`): the trainer's own rule (ops/budget.py) has it stopped, final save included, by
  launched_at + wall_clock_s - reserve_s, i.e. the deadline minus the estimate (plus the seconds between
  this launch and opd_patches.main's import, which the estimate's start-ups cover).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from opd_patches.eval.harness import VLLM_ASSUMED_TOKENS_PER_S
from opd_patches.study.progress import human

# Defaults when nothing was measured yet, chosen low: a reserve that is too short loses the final score,
# one that is too long only a few training steps. GPU: half the harness's own order-of-magnitude figure for
# vLLM; CPU: the hf backend on a small model. Start-up: a process importing torch and loading the model
# (vLLM also builds its engine and CUDA graphs).
DEFAULT_TOKENS_PER_S = {"gpu": VLLM_ASSUMED_TOKENS_PER_S / 2, "cpu": 50.0}
DEFAULT_STARTUP_S = {"gpu": 180.0, "cpu": 30.0}
# Writing the report and the chain's own process starts between the stages.
SLACK_S = 60.0


class DeadlineError(ValueError):
    """A deadline that cannot be used; the message says why."""


def parse_time(text: str) -> float:
    """Epoch seconds of an absolute time: epoch seconds, or ISO 8601 (`2026-12-24T18:00:00+01:00`; without a
    zone: this machine's local time, as `date` prints it)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise DeadlineError(f"DEADLINE={text}: give an ISO 8601 time (2026-12-24T18:00:00+01:00) or epoch seconds") from None


def fix_deadline(stored: dict | None, deadline: str | None, wall_clock: float | None, now: float) -> dict | None:
    """{"deadline", "first_launch", "given"}: the stored one (a later launch: the same deadline), else fixed
    now from `deadline` or `wall_clock` (None: no deadline). A later launch that states another deadline is
    refused (its value would silently not apply)."""
    if deadline is not None and wall_clock is not None:
        raise DeadlineError("give DEADLINE= or WALL_CLOCK=, not both")
    if wall_clock is not None and wall_clock <= 0:
        raise DeadlineError(f"WALL_CLOCK={wall_clock:g}: give positive seconds")
    if stored and stored.get("deadline") is not None:
        first = stored["first_launch"]
        asked = parse_time(deadline) if deadline is not None else (first + wall_clock if wall_clock is not None else None)
        if asked is not None and abs(asked - stored["deadline"]) > 1e-3:
            raise DeadlineError(
                f"the deadline was fixed at the first launch ({iso(stored['deadline'])}, from {stored['given']}); "
                f"now asked: {iso(asked)}. Leave DEADLINE/WALL_CLOCK as they were (or out) to continue toward it, "
                "or pass --new-deadline to replace it")
        return stored
    if deadline is not None:
        return {"deadline": parse_time(deadline), "first_launch": now, "given": f"DEADLINE={deadline}"}
    if wall_clock is not None:
        return {"deadline": now + wall_clock, "first_launch": now, "given": f"WALL_CLOCK={wall_clock:g}"}
    return None


def iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="seconds")


@dataclass
class Evaluation:
    what: str
    count: int  # evaluations of this kind
    questions: int
    samples: int
    max_new_tokens: int

    @property
    def tokens(self) -> int:
        return self.count * self.questions * self.samples * self.max_new_tokens


def kept_exports(keep: int, total_steps: int, save_freq: int) -> int:
    """Exports selection can find: the kept ones (trainer.max_actor_ckpt_to_keep validated + the newest
    complete), and never more than the run saves (every save_freq steps and at its last step)."""
    saves = total_steps // save_freq + (1 if total_steps % save_freq else 0) if save_freq > 0 else 1
    return max(1, min(keep + 1, saves))


def after_training(proxy: dict, final: dict, exports: int) -> list[Evaluation]:
    """The evaluations of selection and the final score. proxy/final: {questions, samples, max_new_tokens}
    of each suite as the selection runs it; exports: `kept_exports`."""
    return [Evaluation("exports on the proxy suite", exports, **proxy),
            Evaluation("student on the proxy suite", 1, **proxy),
            Evaluation("chosen export on the final suite", 1, **final),
            Evaluation("student on the final suite", 1, **final)]


def seconds_needed(evals: list[Evaluation], tokens_per_s: float, startup_s: float) -> float:
    """Every evaluation at its token cap over `tokens_per_s`, a start-up each, and SLACK_S."""
    return sum(e.tokens for e in evals) / tokens_per_s + sum(e.count for e in evals) * startup_s + SLACK_S


def measured_rate(summaries) -> tuple[float, str] | None:
    """(tokens/s, the summary it came from): the slowest of these evaluations' summary.json files, each as
    the samples it generated in its last run times their mean length over its elapsed seconds."""
    rates = []
    for path in summaries:
        try:
            s = json.loads(Path(path).read_text())
            new, mean, elapsed = int(s.get("generated_this_run") or 0), float(s["mean_response_tokens"]), float(s["elapsed_s"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if new > 0 and elapsed > 0 and mean > 0:
            rates.append((new * mean / elapsed, str(path)))
    return min(rates) if rates else None


def throughput(device: str, summaries) -> dict:
    """{"tokens_per_s", "startup_s", "source"}: measured where an evaluation was, else the device's default."""
    measured = measured_rate(summaries)
    if measured is not None:
        return {"tokens_per_s": measured[0], "startup_s": DEFAULT_STARTUP_S[device], "source": f"measured ({measured[1]})"}
    return {"tokens_per_s": DEFAULT_TOKENS_PER_S[device], "startup_s": DEFAULT_STARTUP_S[device],
            "source": f"default for {device} (nothing measured yet)"}


def training_window(deadline: float, reserve_s: float, now: float | None = None) -> tuple[float, float]:
    """(opd.wall_clock_s, opd.reserve_s) for a training launched now: its stop time, launched_at +
    wall_clock_s - reserve_s, is `deadline - reserve_s`. DeadlineError when that time has passed."""
    now = time.time() if now is None else now
    left = deadline - reserve_s - now
    if left <= 0:
        raise DeadlineError(f"no time left to train: the deadline {iso(deadline)} minus {human(reserve_s)} for selection "
                            f"and the final score was {human(-left)} ago")
    return deadline - now, reserve_s

