"""What the on-policy overlap could buy at a length profile: a model fed with measured figures.

    python -m tools.bench.overlap_bound [--lengths seed-math500] [--gen-s 20.0] [--work-s 8.0]
        [--batch 32] [--cap 7168] [--draws 200] [--share NAME:DECODE_SLOWDOWN:TRAIN_SLOWDOWN ...]

The overlap would score and back-propagate each finished sample while the others still decode, and step the
optimizer once after the last one. Model of one step: every live sequence decodes one token per decode step,
a step costing `gen_s / longest` seconds whatever the batch (latency-bound: the time per decode step
grows far less than the batch, docs/performance.md) and `DECODE_SLOWDOWN` times that while training runs beside it;
a finished sample's teacher + update work is `work_s` x its share of the batch's tokens, done at
1 / `TRAIN_SLOWDOWN` of its own rate beside decode and at full rate after the last sequence ends. The
sequential step is gen + work. Shares are the measured pairs of `make bench PHASE=decode --train-shares`
(docs/performance.md, "Training beside decode"); `ideal:1:1` (sharing for free) bounds every real mechanism: the
samples that run to the cap end last and carry the most tokens, so their work cannot overlap anything.
Optimizer step, weight sync and start-up are left out of both sides.
"""

from __future__ import annotations

import argparse
import sys
from statistics import mean

from opd_patches.hooks import lengths as length_profiles

# (name, decode slowdown, training slowdown): the decode phase's pairs (docs/performance.md)
MEASURED = [("ideal", 1.0, 1.0), ("mps-50%", 1.376, 1.784), ("mps-25%", 1.199, 3.633), ("mps-10%", 1.115, 9.018),
            ("mps-no-limit", 4.82, 1.12), ("time-sliced", 2.63, 1.79)]


def draw_lengths(profile: str, batch: int, cap: int, index: int, seed: int = 0) -> list[int]:
    """Batch `index` of response lengths, drawn as the step bench's agent loop draws them (lengths.draw)."""
    return [length_profiles.draw(profile, cap, seed, index, str(i)) for i in range(batch)]


def overlapped_step(lengths: list[int], gen_s: float, work_s: float, decode_slowdown: float,
                    train_slowdown: float) -> float:
    """Seconds of one overlapped step (see the module docstring)."""
    longest, total = max(lengths), sum(lengths)
    per_token = gen_s / longest
    ends = sorted(lengths)
    available = done = t = 0.0
    i = 0
    for token in range(1, longest + 1):
        left = available - done
        slowed = per_token * decode_slowdown
        if left <= 1e-12:  # decode alone
            t += per_token
        elif left * train_slowdown >= slowed:  # training beside this whole decode step
            done += slowed / train_slowdown
            t += slowed
        else:  # the training ends inside this step: the rest of the step decodes alone
            beside = left * train_slowdown
            done = available
            t += beside + per_token * (1 - beside / slowed)
        while i < len(ends) and ends[i] <= token:
            available += work_s * ends[i] / total
            i += 1
    return t + (work_s - done)


def bound(profile: str, gen_s: float, work_s: float, batch: int, cap: int, draws: int,
          shares: list[tuple[str, float, float]], seed: int = 0) -> list[dict]:
    """Per share: the mean overlapped step over `draws` batches, against the sequential gen + work."""
    batches = [draw_lengths(profile, batch, cap, index, seed) for index in range(draws)]
    sequential = gen_s + work_s
    rows = []
    for name, d, r in shares:
        steps = [overlapped_step(b, gen_s, work_s, d, r) for b in batches]
        rows.append({"share": name, "decode_slowdown": d, "train_slowdown": r, "step_s": mean(steps),
                     "sequential_s": sequential, "ratio": mean(steps) / sequential,
                     "ratio_range": (min(steps) / sequential, max(steps) / sequential)})
    return rows


def _share(text: str) -> tuple[str, float, float]:
    name, d, r = text.split(":")
    return name, float(d), float(r)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="seed-math500", help="a profile of opd_patches/hooks/lengths.py, or cap")
    # The defaults: topk at seed-math500, the mean of steps 3 and 4 (docs/performance.md, "Step figures at
    # realistic lengths")
    p.add_argument("--gen-s", type=float, default=19.9, help="generation's seconds for the step (measured)")
    p.add_argument("--work-s", type=float, default=8.05, help="teacher + update seconds for the step (measured)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--cap", type=int, default=7168)
    p.add_argument("--draws", type=int, default=200)
    p.add_argument("--share", type=_share, nargs="*", help="NAME:DECODE_SLOWDOWN:TRAIN_SLOWDOWN (default: measured)")
    a = p.parse_args(argv)
    rows = bound(a.lengths, a.gen_s, a.work_s, a.batch, a.cap, a.draws, a.share or MEASURED)
    print(f"{a.batch} x {a.lengths} (cap {a.cap}), gen {a.gen_s} s + teacher/update {a.work_s} s = "
          f"{a.gen_s + a.work_s:.2f} s sequential; {a.draws} batches")
    print(f"{'share':<14} {'decode x':>8} {'train x':>8} {'step s':>7} {'/ seq':>6} {'range':>13}")
    for r in rows:
        lo, hi = r["ratio_range"]
        print(f"{r['share']:<14} {r['decode_slowdown']:>8.3f} {r['train_slowdown']:>8.3f} {r['step_s']:>7.2f} "
              f"{r['ratio']:>6.3f} {lo:>6.3f}-{hi:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
