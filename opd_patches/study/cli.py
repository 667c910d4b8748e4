"""`make study SPEC=...` = `python -m opd_patches.study SPEC [--out DIR] [--seeds N] [--parallel N] [--force] [--retry-failed] [--dry-run] [--report-only]`

1. Validate the spec (opd_patches/study/spec.py) and plan every (arm, seed): `<out>/runs/<arm>/seed<S>`.
2. Take the one-run lock once (opd_patches/ops/lock.py); every run.sh it starts inherits it through
   OPD_LOCK_HELD. Refused (another run holds it): exit 75.
3. Train the runs one after another (`parallel: N`: N side by side), skipping complete ones (runner.status), with
   a live progress line.
   With `eval.during_training`, a thread evaluates meanwhile: the references first, then each chosen state as
   soon as its receipt is written (`last`: once its run is complete), one evaluation at a time.
4. Evaluate the chosen checkpoints of the complete runs (evaluate.py), skipping complete evaluations.
5. Write report.md, report.json, report.png (report.py).

A summary of what is done and left is printed at the start and at the end. Killed or interrupted
(SIGINT, SIGTERM, SIGHUP), the study stops the training or evaluation it started (its whole process
session) and exits 130; the same command resumes: complete runs and evaluations are skipped, an
interrupted run resumes from its newest complete state. Exit 0 when every run and evaluation is
complete, 1 otherwise, 2 on a spec error.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

from opd_patches.study import evaluate, report, runner
from opd_patches.study.progress import RunProgress, human
from opd_patches.study.spec import REPO, SpecError, load

STUDY_RESULT = "study_result.json"


def log(msg: str) -> None:
    print(f"[study] {msg}", flush=True)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _interrupt(signum, frame):
    # Further signals (a group kill often sends several) must not cut short the clean-up of the child
    # session that this exception starts (runner.run_child); SIGKILL still works.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def _counts(plans, budget) -> dict:
    counts = {"complete": 0, "failed": 0, "partial": 0, "new": 0}
    for p in plans:
        counts[runner.status(p, budget)["state"]] += 1
    return counts


def summary_line(spec, plans, when: str) -> str:
    c = _counts(plans, spec.budget)
    left = c["partial"] + c["new"]
    return (f"{when}: {len(spec.arms)} arms x {len(spec.seeds)} seeds = {len(plans)} runs: {c['complete']} complete, "
            f"{c['failed']} failed (non-finite), {left} to run ({c['partial']} to resume)")


def _record(plan: runner.RunPlan, code: int, seconds: float) -> dict:
    path = plan.run_dir / STUDY_RESULT
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    rec = {"launches": int(old.get("launches", 0)) + 1, "wall_s": round(float(old.get("wall_s", 0.0)) + seconds, 1),
           "last_exit": code}
    runner.receipts.atomic_write_json(path, rec)
    return rec


def train(spec, plans, retry_failed: bool, parallel: int = 1) -> None:
    """Every run not complete (nor failed, unless retry_failed), `parallel` at a time in plan order."""
    todo = []
    for i, plan in enumerate(plans, 1):
        st = runner.status(plan, spec.budget)
        if st["state"] == "complete" or (st["state"] == "failed" and not retry_failed):
            log(f"run {i}/{len(plans)} {plan.label}: {st['state']} ({st['detail']}), skipped")
        else:
            todo.append((i, plan, st))
    walls: list[float] = []
    if parallel <= 1:
        for k, (i, plan, st) in enumerate(todo):
            _train_one(spec, plans, i, plan, st, walls, left_after=len(todo) - k - 1)
        return
    # Side by side (each run.sh starts its own Ray), each started once the one before it has logged a step:
    # start-ups (a dozen processes importing torch and VERL) at once on a small machine slow each other down
    # (and can miss Ray's start-up deadline). Daemon threads: an interrupted study exits, and each run's guard
    # (PR_SET_PDEATHSIG) takes its tree down with it.
    queue = list(todo)
    lock = threading.Lock()
    errors: list[BaseException] = []
    previous = [threading.Event()]
    previous[0].set()

    def worker():
        while True:
            with lock:
                if not queue or errors:
                    return
                i, plan, st = queue.pop(0)
                gate, mine = previous[0], threading.Event()
                previous[0] = mine
            while not gate.wait(timeout=1.0) and not errors:
                pass
            try:
                _train_one(spec, plans, i, plan, st, walls, left_after=len(queue), first_step=mine)
            except BaseException as exc:  # StudyError: stop handing out runs; the main thread raises it
                errors.append(exc)
                return
            finally:
                mine.set()

    threads = [threading.Thread(target=worker, name=f"study-run-{n}", daemon=True) for n in range(min(parallel, len(todo)))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(timeout=1.0)  # a timed join lets SIGINT/SIGTERM reach the main thread
    if errors:
        raise errors[0]


class _Polled:
    """The run's progress as runner.launch polls it; also sets `started` once the run has logged step 1."""

    def __init__(self, progress: RunProgress, started: threading.Event):
        self.progress, self.started = progress, started

    def poll(self):
        line = self.progress.poll()
        if self.progress.step >= 1:
            self.started.set()
        return line


def _train_one(spec, plans, i: int, plan, st: dict, walls: list, left_after: int,
               first_step: threading.Event | None = None) -> None:
    mean = sum(walls) / len(walls) if walls else None
    progress = None

    def study_status(left_after=left_after, mean=mean):
        now = progress.eta() if progress is not None else None
        if mean is None or now is None:  # unknown until a run of this study has ended
            rest = ""
        else:
            rest = f", eta ~{human(mean * left_after + now)}"
        return f"{left_after} run{'s' if left_after != 1 else ''} after this{rest}"

    what = "resuming" if st["state"] == "partial" else "starting"
    log(f"run {i}/{len(plans)} {plan.label}: {what} ({st['detail']}) in {plan.run_dir}")
    progress = RunProgress(plan.run_dir, f"run {i}/{len(plans)} {plan.label}", spec.budget.get("steps"),
                           spec.budget.get("wall_clock_s"), study_status, expected_s=mean)
    started = time.monotonic()
    try:
        shared = spec.parallel > 1 or spec.eval["during_training"]
        code = runner.launch(plan, progress if first_step is None else _Polled(progress, first_step), shared)
    except KeyboardInterrupt:
        _record(plan, "interrupted", time.monotonic() - started)
        raise
    seconds = time.monotonic() - started
    walls.append(seconds)
    _record(plan, code, seconds)
    st = runner.status(plan, spec.budget)
    log(f"run {i}/{len(plans)} {plan.label}: exit {code} after {human(seconds)}: {st['state']} ({st['detail']})"
        + ("" if st["state"] == "complete" else f"; log {plan.run_dir / 'run.log'}"))


class DuringTraining:
    """Evaluations that run while the study trains (`eval.during_training`), one at a time in a thread.

    A job it started is not started again by it (a failure is left to evaluate_all, which runs after
    `finish()`); evaluate_all skips what it completed. Stopped with the study, its evaluation's process
    session goes down with the study process (runner.run_child's guard)."""

    def __init__(self, spec, plans, out: Path):
        self.spec, self.plans, self.out = spec, plans, out
        self.started: set[Path] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="study-eval", daemon=True)

    def _pending(self) -> list:
        jobs = evaluate.reference_jobs(self.spec, self.out)
        for plan in self.plans:
            # `last` is only known once the run is complete; `every` and listed steps as they are saved
            if self.spec.eval["checkpoints"] != "last" or runner.status(plan, self.spec.budget)["state"] == "complete":
                jobs += evaluate.jobs_for(plan, self.spec.eval, self.out)
        return [j for j in jobs if not j.missing and j.out not in self.started and not evaluate.is_done(j, self.spec.eval)]

    def _loop(self) -> None:
        while not self.stop.is_set():
            todo = self._pending()
            if not todo:
                self.stop.wait(runner.POLL_S)
                continue
            job = todo[0]
            self.started.add(job.out)
            res = evaluate.run_job(job, self.spec.eval, shared_cores=True)
            log(f"eval during training: {job.name}: {res['state']}: {res['detail']}"
                + (f" ({human(res['seconds'])})" if res["seconds"] else ""))

    def start(self) -> "DuringTraining":
        self.thread.start()
        return self

    def finish(self) -> None:
        """No new evaluation; wait for the one running."""
        self.stop.set()
        self.thread.join()


def evaluate_all(spec, plans, out: Path) -> tuple[list, dict]:
    jobs = evaluate.reference_jobs(spec, out)
    for plan in plans:
        if runner.status(plan, spec.budget)["state"] == "complete":
            jobs += evaluate.jobs_for(plan, spec.eval, out)
    results = {}
    todo = [j for j in jobs if not j.missing and not evaluate.is_done(j, spec.eval)]
    log(f"evaluations: {len(jobs)} ({len(jobs) - len(todo)} complete or missing, {len(todo)} to run)")
    for i, job in enumerate(jobs, 1):
        res = evaluate.run_job(job, spec.eval)
        results[id(job)] = res
        log(f"eval {i}/{len(jobs)} {job.name}: {res['state']}: {res['detail']}"
            + (f" ({human(res['seconds'])})" if res["seconds"] else ""))
    return jobs, results


def _finish(spec, plans, jobs, results, out: Path) -> int:
    for p in plans:
        st = runner.status(p, spec.budget)
        p.result = {"state": st["state"], "detail": st["detail"], "last_step": st["last_step"]}
    data = report.build(spec, plans, jobs, results)
    paths = report.write(out, data)
    for g in data["groups"]:
        for arm, d in g["diffs"].items():
            log(f"{g['suite']} ({g['checkpoint']}): {d['verdict']}")
    log(summary_line(spec, plans, "end"))
    states = [r.get("state") for r in results.values()]
    log(f"end: evaluations: {states.count('done')} run, {states.count('skipped')} already complete, "
        f"{states.count('failed')} failed, {states.count('missing')} missing")
    log(f"report: {paths['md']}, {paths['json']}" + (f", {paths['png']}" if paths["png"] else "")
        + (f", {paths['summary']}" + (f", {paths['curves']}" if paths.get("curves") else "") if paths.get("summary") else ""))
    if paths.get("table"):
        print(paths["table"], flush=True)
    ok = all(p.result["state"] == "complete" for p in plans) and all(s in ("done", "skipped") for s in states)
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opd_patches.study", description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path, help="study spec YAML (e.g. recipes/studies/k1_vs_topk.yaml)")
    ap.add_argument("--out", type=Path, help="study folder (default outputs/studies/<name>)")
    ap.add_argument("--force", action="store_true", help="start although another run holds the lock (opd.force)")
    ap.add_argument("--retry-failed", action="store_true", help="run again the runs that stopped on non-finite values")
    ap.add_argument("--seeds", type=int, help="run seeds 1..N of every arm instead of the spec's `seeds` (make learn SEEDS=N)")
    ap.add_argument("--parallel", type=int, help="train this many runs side by side instead of the spec's `parallel`")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (run.sh commands) and what is done; run nothing")
    ap.add_argument("--report-only", action="store_true", help="write the report from what is on disk; run nothing")
    args = ap.parse_args(argv)
    try:
        spec = load(args.spec)
    except SpecError as exc:
        print(f"[study] spec error: {exc}", file=sys.stderr)
        return 2
    if args.seeds is not None:
        if args.seeds < 1:
            print(f"[study] --seeds {args.seeds}: give a positive number of seeds", file=sys.stderr)
            return 2
        spec.seeds = list(range(1, args.seeds + 1))
    if args.parallel is not None:
        if args.parallel < 1:
            print(f"[study] --parallel {args.parallel}: give a positive number of runs", file=sys.stderr)
            return 2
        spec.parallel = args.parallel
    for w in spec.warnings:
        log(f"warning: {w}")
    out = (args.out or REPO / "outputs" / "studies" / spec.name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    plans = runner.plan_runs(spec, out)
    runner.receipts.atomic_write_json(out / "study.json", {
        "spec": str(spec.path.resolve()), "spec_text": spec.path.read_text(), "control": spec.control,
        "runs": [{"arm": p.arm, "seed": p.seed, "command": p.command(), "env": p.env} for p in plans]})
    log(f"{spec.name}: folder {out}; control {spec.control}; arms {', '.join(a.name for a in spec.arms)}")
    log(summary_line(spec, plans, "start"))
    if args.dry_run:
        for p in plans:
            st = runner.status(p, spec.budget)
            env = " ".join(f"{k}={v}" for k, v in p.env.items())
            log(f"{p.label} [{st['state']}]: {env + ' ' if env else ''}OUTPUT_DIR={p.run_dir} {' '.join(p.command())}")
        return 0
    if args.report_only:
        jobs = evaluate.reference_jobs(spec, out) + [
            j for p in plans if runner.status(p, spec.budget)["state"] == "complete" for j in evaluate.jobs_for(p, spec.eval, out)]
        return _finish(spec, plans, jobs, {}, out)

    from opd_patches.ops import lock

    device = spec.env.get("DEVICE") or __import__("os").environ.get("DEVICE", "auto")
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)
    try:
        with lock.acquire(force=args.force, gpus=[] if device == "cpu" else None, run=out,
                          command=" ".join(sys.argv)):
            during = DuringTraining(spec, plans, out).start() if spec.eval["during_training"] else None
            try:
                train(spec, plans, args.retry_failed, spec.parallel)
            finally:
                if during is not None:
                    during.stop.set()  # interrupted: start nothing new; the study's exit stops the one running
            if during is not None:
                during.finish()
            jobs, results = evaluate_all(spec, plans, out)
            return _finish(spec, plans, jobs, results, out)
    except lock.BUSY as exc:
        print(f"[study] refused: {exc}", file=sys.stderr, flush=True)
        return lock.EXIT_BUSY
    except runner.StudyError as exc:
        print(f"[study] error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as exc:
        log(f"interrupted ({exc or 'SIGINT'}); the process tree it started was stopped")
        log(summary_line(spec, plans, "now") + "; the same command resumes")
        return 130
