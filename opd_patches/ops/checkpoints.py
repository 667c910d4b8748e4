"""The trainer states of a run folder: listing, the newest complete one, pruning.

    python -m opd_patches.ops.checkpoints list RUN_DIR [--json] [--verify]
    python -m opd_patches.ops.checkpoints prune RUN_DIR --keep N [--dry-run]

A state is upstream's `<run>/global_step_N/` folder; *complete* and *validated* are defined in
receipts.py. Everything here reads the disk, never a process's memory, so states left by an earlier
process (before a crash or a restart) are listed and pruned like this process's own.

Pruning rules (`plan_prune`):
- keep the newest `keep` *validated* states: a state whose export failed validation (or was not
  validated) never counts, so it never displaces the last validated one;
- keep the newest complete state (the resume point), validated or not;
- remove every other complete state; incomplete folders older than the newest complete state are
  debris of an interrupted save and are removed; incomplete folders newer than it are left alone (a
  save, or its background finish, may be in progress); `discard_after` removes them when a resume
  starts from an older state (they would be overwritten).
With `opd.validate_after_save=false` nothing is validated, so only the newest complete state is kept.

Resume (`resume_point`) re-hashes the newest complete state against its receipt and falls back to
the next older complete state when a file differs (the rejected receipt is set aside, naming the file).
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


def list_states(run_dir: Path, verify: bool = False) -> list[dict]:
    """Every global_step_N folder, oldest first: {step, path, complete, validated, reason}.

    validated: the receipt's validation result (True/False), None when incomplete or not validated;
    a state is *validated* only when it is True. reason: why an incomplete state is incomplete (None
    when complete). verify: also re-hash each complete state's files (slow; reads everything).
    """
    states = []
    for step, path in _step_dirs(run_dir):
        why = receipts.problem(path, step)
        if why is None and verify:
            why = _hash_problem(path)
        validated = None
        if why is None:
            ok = (receipts.read(path, step).get("validation") or {}).get("ok")
            validated = ok if isinstance(ok, bool) else None
        states.append({"step": step, "path": path, "complete": why is None, "validated": validated, "reason": why})
    return states


def _hash_problem(path: Path) -> str | None:
    bad = receipts.verify(path)
    return f"sha256 differs from receipt: {', '.join(bad)}" if bad else None


def newest_complete(run_dir: Path) -> Path | None:
    """The folder of the newest complete state, or None."""
    complete = [s for s in list_states(run_dir) if s["complete"]]
    return complete[-1]["path"] if complete else None


def newest_validated(run_dir: Path) -> Path | None:
    """The folder of the newest validated state (the run's result), or None."""
    validated = [s for s in list_states(run_dir) if s["complete"] and s["validated"] is True]
    return validated[-1]["path"] if validated else None


def resume_point(run_dir: Path, log=print) -> Path | None:
    """The newest complete state whose files match their receipt's sha256, checked newest first.

    A state whose file differs gets its receipt set aside (receipts.reject: it becomes incomplete,
    the listing names the file) and the next older complete state is tried. Each state is hashed
    at most once per call, and only until one matches.
    """
    for s in reversed([s for s in list_states(run_dir) if s["complete"]]):
        why = _hash_problem(s["path"])
        if why is None:
            return s["path"]
        receipts.reject(s["path"], why)
        log(f"[opd] resume: {s['path']} is not resumed from: {why}; trying the next older complete state", flush=True)
    return None


def plan_prune(states: list[dict], keep: int) -> list[dict]:
    """The states to remove under the rules in the module docstring (pure: no disk access)."""
    keep = max(1, int(keep))
    complete = [s for s in states if s["complete"]]
    if not complete:
        return []
    validated = [s for s in complete if s["validated"] is True]
    newest = complete[-1]["step"]
    kept = {s["step"] for s in validated[-keep:]} | {newest}
    # Incomplete folders newer than the newest complete state may still be finishing: left alone.
    return [s for s in states if s["step"] not in kept and (s["complete"] or s["step"] < newest)]


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
    ls.add_argument("--verify", action="store_true", help="also re-hash every file against its receipt's sha256 (slow)")
    pr = sub.add_parser("prune", help="keep the newest N validated states and the newest complete one (as after each save)")
    pr.add_argument("run_dir", type=Path)
    pr.add_argument("--keep", type=int, required=True)
    pr.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"{args.run_dir}: no such run folder", file=sys.stderr)
        return 2
    if args.cmd == "list":
        states = list_states(args.run_dir, verify=args.verify)
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
