"""The chain's record, `<out>/chain.json`: the deadline fixed at the first launch and, per stage, the inputs it ran
with, its wall time over all launches and whether it finished. A launch compares its inputs with the record
(`check_recorded`) before anything runs, and a stage is skipped only when it finished with the same inputs and
its result is still there (`decide`)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from opd_patches.ops import receipts

STATE = "chain.json"


class ChainError(ValueError):
    """Input the chain cannot work with, or inputs that differ from the recorded ones; exit 2."""


def files_fingerprint(path: str) -> str:
    """A model folder's identity, cheap to recompute at every launch: each file's relative path, size and
    modification time (a rewritten model changes it); a hub id is known by its name only."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return "not a local folder"
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(folder).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def differences(old: dict, new: dict) -> list[str]:
    """`key: old -> new` for every key whose value differs (a key on one side only included)."""
    gone = "(unset)"
    return [f"{k}: {json.dumps(old.get(k, gone))} -> {json.dumps(new.get(k, gone))}"
            for k in sorted(set(old) | set(new)) if old.get(k, gone) != new.get(k, gone)]


def check_recorded(state: dict, inputs: dict[str, dict], out: Path) -> None:
    """ChainError naming every difference between a recorded stage's inputs and this launch's."""
    found: list[str] = []
    for stage, record in state.get("stages", {}).items():
        if stage in inputs:
            found += [d for d in differences(record.get("inputs", {}), inputs[stage]) if d not in found]
    if found:
        raise ChainError(f"{out} holds a run made with other inputs ({'; '.join(found)}); its results would mix with "
                         f"this one's. Give the same inputs to continue it, or another OUT= (or delete {out}) to start anew")


def decide(record: dict | None, inputs: dict, result_exists: bool) -> str:
    """'skip' when the stage finished with these inputs and its result is still there, else 'run' (a
    record with other inputs never reaches here: check_recorded refuses it first)."""
    if record and record.get("finished_at") and record.get("inputs") == inputs and result_exists:
        return "skip"
    return "run"


def load(out: Path) -> dict:
    """The record in `out` ({} before the first launch)."""
    try:
        return json.loads((out / STATE).read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise ChainError(f"{out / STATE} is not JSON ({exc}): restore it or start in another OUT=") from None


def save(out: Path, state: dict) -> None:
    receipts.atomic_write_json(out / STATE, state)


def stage_done(state: dict, stage: str, inputs: dict, started: float, finished: bool, note: str = "") -> None:
    """Add one launch of `stage` (its inputs, the seconds since `started`, finished or not) to `state`."""
    rec = state.setdefault("stages", {}).get(stage) or {}
    rec.update(inputs=inputs, wall_s=round(float(rec.get("wall_s", 0.0)) + time.time() - started, 1),
               launches=int(rec.get("launches", 0)) + 1, finished_at=time.time() if finished else None)
    if note:
        rec["note"] = note
    state["stages"][stage] = rec
