"""Live progress of a training run from its `metrics.jsonl` (`{"step": N, "data": {...}}` per line).

`RunProgress.poll()` is called every few seconds while a run trains; it returns a line when a new step
was logged, or a heartbeat line every `heartbeat_s` otherwise:

    [study] run 2/4 topk seed 1: step 3/10, elapsed 2m10s, 14.2 s/step, eta 1m40s | study: 2 runs after this, eta ~9m

Seconds per step are measured on the wall clock between the steps this monitor saw appear (so saves,
export validation and logging are included), averaged over the last `WINDOW` intervals; before two
steps are seen, step 1's own `timing_s/step` (an over-estimate: it includes warm-up); before step 1, the
mean duration of the study's earlier runs (`expected_s`) minus the time elapsed. With a wall clock
(`opd.wall_clock_s`) the ETA is capped by the time left on it.
"""  # lint: allow-figure (an example of the line it prints)

from __future__ import annotations

import json
import time
from pathlib import Path

WINDOW = 5


def human(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(0.0, float(seconds))
    if seconds >= 3600:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    if seconds >= 60:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{seconds:.0f} s"


def read_steps(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """New complete lines of a metrics.jsonl from byte `offset`: (records, new offset). A file shorter than
    `offset` was rotated (a relaunch keeps the old one as metrics.1.jsonl): read from the start."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError:
        return [], 0
    if size < offset:
        offset = 0
    with open(path, "rb") as fh:
        fh.seek(offset)
        chunk = fh.read()
    end = chunk.rfind(b"\n") + 1  # a line still being written is read next time
    records = []
    for line in chunk[:end].splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            records.append(rec)
    return records, offset + end


class RunProgress:
    def __init__(self, run_dir: Path, label: str, total_steps: int | None, wall_clock_s: float | None = None,
                 study_status=None, heartbeat_s: float = 60.0, clock=time.monotonic, expected_s: float | None = None):
        self.metrics = Path(run_dir) / "metrics.jsonl"
        self.label, self.total, self.wall_clock_s = label, total_steps, wall_clock_s
        self.study_status = study_status or (lambda: "")
        self.heartbeat_s, self.clock, self.expected_s = heartbeat_s, clock, expected_s
        self.started = clock()
        self.last_line_at = self.started
        self.offset, self.step, self.seen = 0, 0, []  # seen: (monotonic time, step) of steps appearing
        self.first_step_s = None

    def seconds_per_step(self) -> float | None:
        if len(self.seen) >= 2:
            recent = self.seen[-(WINDOW + 1):]
            return (recent[-1][0] - recent[0][0]) / (recent[-1][1] - recent[0][1])
        return self.first_step_s

    def eta(self) -> float | None:
        per = self.seconds_per_step()
        eta = None if per is None or self.total is None else max(0, self.total - self.step) * per
        if eta is None and self.expected_s:  # before step 1: earlier runs' mean duration
            eta = max(0.0, self.expected_s - (self.clock() - self.started))
        if self.wall_clock_s:
            left = self.wall_clock_s - (self.clock() - self.started)
            eta = left if eta is None else min(eta, left)
        return eta

    def line(self) -> str:
        total = f"/{self.total}" if self.total else ""
        per = self.seconds_per_step()
        what = f"step {self.step}{total}" if self.step else "starting (Ray, models, step 1)"
        text = (f"[study] {self.label}: {what}, elapsed {human(self.clock() - self.started)}"
                f"{f', {per:.1f} s/step' if per else ''}, eta {human(self.eta())}")
        extra = self.study_status()
        return f"{text} | study: {extra}" if extra else text

    def poll(self) -> str | None:
        records, self.offset = read_steps(self.metrics, self.offset)
        now = self.clock()
        new = False
        for rec in records:
            if rec["step"] > self.step:
                if self.first_step_s is None:
                    self.first_step_s = float(rec.get("data", {}).get("timing_s/step") or (now - self.started))
                self.step = rec["step"]
                new = True
        if new:  # one entry per poll: steps read together carry no time between them
            self.seen.append((now, self.step))
        if new or now - self.last_line_at >= self.heartbeat_s:
            self.last_line_at = now
            return self.line()
        return None
