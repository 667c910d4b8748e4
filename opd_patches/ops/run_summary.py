"""`<run>/run_summary.json`: how a training process ended (shared contract).

    {"status": "finished" | "wall_clock" | "non_finite" | "error",
     "steps_done": int,              # the last step this process completed (0: none)
     "reason": str,
     "last_complete_step": int|null, # newest complete state on disk (where a relaunch resumes)
     "last_validated_step": int|null,# newest validated state: the run's result (receipts.py defines both)
     ...}                            # extra keys: requested_steps, step and save timings, written_at

Written atomically by the trainer when its fit loop ends, read by opd_patches.main for the exit
status and the final summary line.
"""

import datetime as _dt
import json
from pathlib import Path

from opd_patches.ops import checkpoints, receipts

NAME = "run_summary.json"
EXIT_CODES = {"finished": 0, "wall_clock": 0, "non_finite": 3, "error": 1}


def write(run_dir: Path, status: str, steps_done: int, reason: str, **extra) -> dict:
    newest, result = checkpoints.newest_complete(run_dir), checkpoints.newest_validated(run_dir)
    summary = {
        "status": status,
        "steps_done": int(steps_done),
        "reason": reason,
        "last_complete_step": int(newest.name.split("_")[-1]) if newest else None,
        "last_validated_step": int(result.name.split("_")[-1]) if result else None,
        **extra,
        "written_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    receipts.atomic_write_json(Path(run_dir) / NAME, summary)
    return summary


def read(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / NAME).read_text())
    except (OSError, ValueError):
        return None


def line(summary: dict) -> str:
    return (f"[opd] run ended: {summary['status']} after step {summary['steps_done']}; newest validated state: "
            f"{summary.get('last_validated_step')} (resume point: {summary['last_complete_step']}); {summary['reason']}")
