"""The bench JSON: one file, one entry per phase, each phase rewritten atomically by its own run.

Schema: {"phases": {phase: {"size", "machine", "written_at", "rows": [row, ...], ...}}}; rows as
measure.row. Other phases' entries are kept as they were (read, update own phase, tmp + os.replace).
"""

import datetime
import json
import os
import platform
from pathlib import Path

import torch


def machine() -> dict:
    info = {"host": platform.node(), "torch": torch.__version__, "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


def merge(path: Path, phase: str, entry: dict) -> dict:
    """Write `entry` as `phase` into the JSON at `path` (created if absent); returns the whole document."""
    path = Path(path)
    doc = json.loads(path.read_text()) if path.exists() else {}
    if not isinstance(doc.get("phases"), dict):
        doc = {"phases": {}}
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    doc["phases"][phase] = {**entry, "machine": machine(), "written_at": stamp}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return doc


def report(path: Path, phase: str, entry: dict) -> None:
    """`merge` the phase into the JSON at `path`, then print its table and where it went."""
    merge(path, phase, entry)
    print(table(phase, entry))
    print(f"[bench] wrote phase {phase} to {path}", flush=True)


def _fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def table(phase: str, entry: dict) -> str:
    """Plain-text table of one phase's rows (times in s, memory in GiB, ratios real/reference)."""
    head = f"{'phase/' + phase:<44} {'time_s':>8} {'ref_s':>8} {'ratio':>6} {'tok/s':>9} {'peak':>7} {'ref_pk':>7} {'pk_rat':>6}"
    lines = [f"== {phase} (size {entry.get('size')}) ==", head]
    for r in entry["rows"]:
        lines.append(
            f"{r['name']:<44} {_fmt(r['time_s'], '8.3f')} {_fmt(r.get('ref_time_s'), '8.3f')} "
            f"{_fmt(r.get('ratio'), '6.2f')} {_fmt(r['tok_per_s'], '9.0f')} {_fmt(r.get('peak_gib'), '7.2f')} "
            f"{_fmt(r.get('ref_peak_gib'), '7.2f')} {_fmt(r.get('peak_ratio'), '6.2f')}"
        )
    for note in entry.get("notes", []):
        lines.append(f"  note: {note}")
    return "\n".join(lines)
