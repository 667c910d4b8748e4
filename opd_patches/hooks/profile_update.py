"""`opd.debug.profile_update=N`: torch.profiler over the N-th actor update of a launch (BENCH ONLY).

The bench's plain update (`make bench PHASE=kernels`, row update/floor) runs at about a third of the
time VERL's update_actor takes inside a step on the same GPU, and the shorter phases do not show where
the rest goes. This wraps the worker's `actor.train_mini_batch` (upstream's one call per mini-batch,
workers/engine_workers.py `update_actor`) on every rank and, for the N-th call only, records CPU and
CUDA activity and writes to the run folder:
- `profile_update_rank<r>.txt`: wall time, GPU-busy time (sum of kernel times), then the operators
  by self CUDA time and by CPU time (torch.profiler's key_averages tables);
- `profile_update_rank<r>.json`: the same totals and the top operators, for scripts.
Every call prints its wall-clock stamps (the trainer prints its own around `update_actor`, so the
log shows the time outside the worker's loop); N past the last update times them only. Read from the run's
config (opd_patches/config.py: `debug.profile_update`, reports in `run_dir`).
"""

import json
import time
from pathlib import Path

from opd_patches import config

ROWS = 40


def requested() -> int | None:
    """The update to profile in this run (`opd.debug.profile_update`), None when off."""
    return config.current().debug.profile_update


def install(worker) -> None:
    """Wrap `worker.actor.train_mini_batch` when `opd.debug.profile_update` asks for it (idempotent; the
    run-time patch opd_patches/patches/train_mini_batch.py). Reports go to the run folder."""
    from opd_patches.patches import train_mini_batch

    n, run_dir = requested(), config.current().run_dir
    actor = getattr(worker, "actor", None)
    if n is None or actor is None:
        return
    if run_dir is None:
        raise RuntimeError("opd.debug.profile_update: no run folder in this process's config (opd_patches.main sets "
                           "it); a test sets one with opd_patches.config.override(run_dir=...).")
    folder, rank = Path(run_dir), getattr(worker, "rank", 0)
    calls = [0]

    def around(original, *args, **kwargs):
        calls[0] += 1
        start = time.time()
        out = _profiled(original, args, kwargs, folder, rank, n) if calls[0] == n else original(*args, **kwargs)
        end = time.time()  # stamps: the trainer prints its own around update_actor (the gap: dispatch, transfer)
        print(f"[opd] profile_update: rank {rank} update {calls[0]} train_mini_batch {start:.3f} -> {end:.3f} "
              f"({end - start:.2f} s)", flush=True)
        return out

    train_mini_batch.apply(actor, around)


def _profiled(fn, args, kwargs, folder: Path, rank: int, n: int):
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    print(f"[opd] opd.debug.profile_update: profiling update {n} on rank {rank}", flush=True)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    write(prof.key_averages(), wall, folder, rank, n)
    return out


def _self_device_us(event) -> float:
    return float(event.self_device_time_total)


def write(averages, wall_s: float, folder: Path, rank: int, n: int) -> dict:
    """Write the text and JSON reports of one profiled update; returns the JSON summary."""
    from torch.autograd import DeviceType

    events = list(averages)
    # as torch's own table total: kernels are counted under the CPU ops that launched them (GPU-side
    # ranges such as upstream's mini_batch/micro_batch annotations would count the same time again)
    device_s = sum(_self_device_us(e) for e in events if e.device_type == DeviceType.CPU) / 1e6
    by_device = sorted(events, key=_self_device_us, reverse=True)[:ROWS]
    by_cpu = sorted(events, key=lambda e: e.cpu_time_total, reverse=True)[:ROWS]
    summary = {
        "update": n, "rank": rank, "wall_s": wall_s, "device_busy_s": device_s,
        "device_busy_fraction": device_s / wall_s if wall_s else None,
        "top_device": [{"name": e.key, "calls": e.count, "self_device_s": _self_device_us(e) / 1e6}
                       for e in by_device],
        "top_cpu": [{"name": e.key, "calls": e.count, "cpu_total_s": e.cpu_time_total / 1e6,
                     "self_cpu_s": e.self_cpu_time_total / 1e6} for e in by_cpu],
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"profile_update_rank{rank}.json").write_text(json.dumps(summary, indent=1))
    head = (f"update {n}, rank {rank}: wall {wall_s:.3f} s, device busy {device_s:.3f} s "
            f"({summary['device_busy_fraction'] or 0:.0%})\n\n")
    tables = [averages.table(sort_by="self_device_time_total", row_limit=ROWS) if device_s else "",
              averages.table(sort_by="cpu_time_total", row_limit=ROWS)]
    (folder / f"profile_update_rank{rank}.txt").write_text(head + "\n\n".join(tables))
    print(f"[opd] opd.debug.profile_update: {head.strip()} -> {folder}/profile_update_rank{rank}.txt", flush=True)
    return summary
