"""The trainer states of a run folder: listing, the newest complete one, pruning.

    python -m opd_patches.ops.checkpoints list RUN_DIR [--json]
    python -m opd_patches.ops.checkpoints prune RUN_DIR --keep N [--dry-run]

A state is upstream's `<run>/global_step_N/` folder; it is *complete* only when its receipt
(receipts.py) proves it. Everything here reads the disk, never a process's memory, so states left
by an earlier process (before a crash or a restart) are listed and pruned like this process's own.

Pruning rules (`plan_prune`), in this order:
- keep the newest `keep` complete states (always at least the newest complete one);
- never remove a complete state whose successor folder is incomplete and newer than every complete
  state (a save that may still be in progress, or that may never complete);
- incomplete folders older than the newest complete state are debris of an interrupted save and
  are removed; incomplete folders newer than it are left alone (a save may be in progress);
  `discard_after` removes them when a resume starts from an older state (they would be overwritten).
"""

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from opd_patches.ops import receipts

STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found)


def list_states(run_dir: Path) -> list[dict]:
    """Every global_step_N folder, oldest first: {step, path, complete, validated, reason}.

    validated: the receipt's validation result (True/False), None when incomplete or not validated.
    reason: why an incomplete state is incomplete (None when complete).
    """
    states = []
    for step, path in _step_dirs(run_dir):
        why = receipts.problem(path, step)
        validated = None
        if why is None:
            ok = (receipts.read(path, step).get("validation") or {}).get("ok")
            validated = ok if isinstance(ok, bool) else None
        states.append({"step": step, "path": path, "complete": why is None, "validated": validated, "reason": why})
    return states


def newest_complete(run_dir: Path) -> Path | None:
    """The folder of the newest complete state, or None."""
    complete = [s for s in list_states(run_dir) if s["complete"]]
    return complete[-1]["path"] if complete else None


def plan_prune(states: list[dict], keep: int) -> list[dict]:
    """The states to remove under the rules in the module docstring (pure: no disk access)."""
    keep = max(1, int(keep))
    complete = [s for s in states if s["complete"]]
    if not complete:
        return []
    kept = {s["step"] for s in complete[-keep:]}
    newest = complete[-1]["step"]
    remove = []
    for i, s in enumerate(states):
        if s["complete"]:
            successor = states[i + 1] if i + 1 < len(states) else None
            # A successor still being written (incomplete, newer than every complete state) may never
            # complete: its complete predecessor stays. Older incomplete folders are debris (removed below).
            pending = successor is not None and not successor["complete"] and successor["step"] > newest
            if s["step"] not in kept and not pending:
                remove.append(s)
        elif s["step"] < newest:
            remove.append(s)
    return remove


def prune(run_dir: Path, keep: int, dry_run: bool = False) -> list[int]:
    """Remove what `plan_prune` names; returns the removed steps."""
    removed = []
    for s in plan_prune(list_states(run_dir), keep):
        if not dry_run:
            shutil.rmtree(s["path"], ignore_errors=True)
        removed.append(s["step"])
    return removed


def discard_after(run_dir: Path, step: int) -> list[int]:
    """Remove incomplete state folders newer than `step` (a resume from `step` rewrites them)."""
    removed = []
    for s in list_states(run_dir):
        if s["step"] > step and not s["complete"]:
            shutil.rmtree(s["path"], ignore_errors=True)
            removed.append(s["step"])
    return removed


def format_table(states: list[dict]) -> str:
    if not states:
        return "(no global_step_N folders)"
    rows = [f"{'step':>6}  {'complete':8}  {'validated':9}  path / reason"]
    for s in states:
        val = {True: "ok", False: "FAILED", None: "-"}[s["validated"]]
        note = str(s["path"]) if s["complete"] else f"{s['path']}  ({s['reason']})"
        rows.append(f"{s['step']:>6}  {'yes' if s['complete'] else 'NO':8}  {val:9}  {note}")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="List or prune a run folder's trainer states.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="every global_step_N folder with completeness and validation")
    ls.add_argument("run_dir", type=Path)
    ls.add_argument("--json", action="store_true")
    pr = sub.add_parser("prune", help="keep the newest N complete states (the trainer does this after each save)")
    pr.add_argument("run_dir", type=Path)
    pr.add_argument("--keep", type=int, required=True)
    pr.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"{args.run_dir}: no such run folder", file=sys.stderr)
        return 2
    if args.cmd == "list":
        states = list_states(args.run_dir)
        if args.json:
            print(json.dumps([{**s, "path": str(s["path"])} for s in states], indent=1))
        else:
            print(format_table(states))
        return 0
    removed = prune(args.run_dir, args.keep, dry_run=args.dry_run)
    print(("would remove" if args.dry_run else "removed") + f" steps: {removed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
