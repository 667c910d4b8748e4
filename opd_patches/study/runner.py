"""One (arm, seed) training run of a study: its folder, whether it is done, and launching it via run.sh.

Run folder `<out>/runs/<arm>/seed<S>` (= run.sh's OUTPUT_DIR = trainer.default_local_dir) holds, besides
what every run writes (manifest, metrics.jsonl, global_step_N/ with receipts, run_summary.json):
- `study_run.json`: the run's identity (recipe, overrides, env), written before the first launch; a later
  study with other settings for the same folder is refused (its states would mix);
- `study_child.json`: the session id of the launched process tree; a study refuses to start a run while
  a process of an earlier launch still lives (after waiting LEFTOVER_WAIT_S for it to end);
- `run.log`: run.sh's output (appended per launch).

Each launch runs under `opd_patches.study.guard` (the leader of the run's session), which takes the
whole tree down (Ray's processes included) when the study dies, even by SIGKILL.

A run is *complete* when its run_summary.json says finished (with at least the budget's steps) or
wall_clock, and a complete (receipted) state exists; *failed* when it says non_finite (not retried:
`--retry-failed`); anything else (new, killed, crashed) is launched again with trainer.resume_mode=auto,
which resumes from the newest complete state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from opd_patches.ops import checkpoints, receipts
from opd_patches.ops import run_summary
from opd_patches.study import guard
from opd_patches.study.guard import session_pids
from opd_patches.study.spec import REPO, Spec, seed_overrides

IDENTITY = "study_run.json"
CHILD = "study_child.json"
DONE_STATUSES = ("finished", "wall_clock")
POLL_S = 2.0
LEFTOVER_WAIT_S = 60.0  # a killed study's guard may still be stopping the tree when the study is relaunched


class StudyError(RuntimeError):
    """The study cannot go on; the message says what to do."""


@dataclass
class RunPlan:
    arm: str
    seed: int
    recipe: str
    overrides: list[str]  # everything after recipe= on run.sh's command line
    env: dict
    run_dir: Path
    note: str = ""
    result: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.arm} seed {self.seed}"

    def identity(self) -> dict:
        """What makes two launches the same run (the budget may grow: a longer budget resumes the run; the
        experiment name, the study's name in loggers, changes no training: another study's run of the same arm
        copied into --out is reused)."""
        return comparable({"arm": self.arm, "seed": self.seed, "recipe": self.recipe, "env": self.env,
                            "overrides": self.overrides})

    def command(self) -> list[str]:
        return [str(REPO / "run.sh"), f"recipe={self.recipe}", *self.overrides]


def plan_runs(spec: Spec, out: Path) -> list[RunPlan]:
    """Every (arm, seed), arm-major. Override order: resume + name, common, arm, budget, seed (last: it wins)."""
    plans = []
    for arm in spec.arms:
        for seed in spec.seeds:
            overrides = ["trainer.resume_mode=auto", f"trainer.experiment_name={spec.name}-{arm.name}-seed{seed}",
                         *spec.overrides, *arm.overrides, *spec.budget_overrides(), *seed_overrides(seed)]
            plans.append(RunPlan(arm.name, seed, arm.recipe, overrides, dict(spec.env),
                                 Path(out) / "runs" / arm.name / f"seed{seed}", arm.note))
    return plans


def status(plan: RunPlan, budget: dict) -> dict:
    """{"state": complete|failed|partial|new, "detail": str, "summary": run_summary or None, "last_step": int|None}."""
    run_dir = plan.run_dir
    newest = checkpoints.newest_complete(run_dir)
    last = int(newest.name.split("_")[-1]) if newest else None
    summ = run_summary.read(run_dir)
    base = {"summary": summ, "last_step": last}
    if summ is None:
        state = "partial" if run_dir.exists() and any(run_dir.iterdir()) else "new"
        return {**base, "state": state, "detail": "no run_summary.json" if state == "partial" else "not started"}
    st = summ.get("status")
    if st in DONE_STATUSES and last is not None:
        steps = budget.get("steps")
        if st == "finished" and steps is not None and int(summ.get("steps_done") or 0) < steps and (last or 0) < steps:
            return {**base, "state": "partial", "detail": f"finished {summ.get('steps_done')} steps, budget now {steps}"}
        return {**base, "state": "complete", "detail": f"{st} after step {summ.get('steps_done')}, newest complete state {last}"}
    if st == "non_finite":
        return {**base, "state": "failed", "detail": f"non_finite: {summ.get('reason')}"}
    return {**base, "state": "partial", "detail": f"status {st}: {summ.get('reason')}"}


NOT_IDENTITY = ("trainer.total_training_steps=", "opd.wall_clock_s=", "opd.reserve_s=", "trainer.experiment_name=")


def comparable(identity):
    """An identity without the overrides that do not make another run (NOT_IDENTITY); applied to the
    study_run.json a folder holds too, which may list them."""
    if not isinstance(identity, dict) or not isinstance(identity.get("overrides"), list):
        return identity
    return {**identity, "overrides": [o for o in identity["overrides"] if not str(o).startswith(NOT_IDENTITY)]}


def check_identity(plan: RunPlan) -> None:
    path = plan.run_dir / IDENTITY
    mine = plan.identity()
    if path.exists():
        try:
            old = comparable(json.loads(path.read_text()))
        except ValueError:
            old = None
        if old != mine:
            raise StudyError(
                f"{plan.run_dir} holds a run made with other settings ({path}: {old} != now {mine}); its states "
                "would mix with this one. Use another --out / OUT=, or delete that run folder")
    else:
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        receipts.atomic_write_json(path, mine)


def check_no_leftover(plan: RunPlan) -> None:
    path = plan.run_dir / CHILD
    if not path.exists():
        return
    try:
        sid = int(json.loads(path.read_text())["sid"])
    except (ValueError, KeyError, TypeError):
        return
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while (alive := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(1)
    if alive:
        raise StudyError(f"{plan.label}: processes of an earlier launch of this run still live (session {sid}, pids "
                         f"{alive[:8]}); stop them (kill -- -{sid}) or wait, then start the study again")


def stop_session(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the guard (it stops its command's group within guard.GRACE_S), SIGKILL it after `grace_s`,
    then any process left in its session."""
    guard.stop_group(proc, grace_s)
    guard.kill_session(proc.pid, timeout=10)


def run_child(cmd: list[str], env: dict, log_path: Path, child_file: Path | None = None, poll=None) -> int:
    """Run `cmd` in its own session, under the guard, with output appended to `log_path`; `poll()` is called
    every POLL_S (its non-empty return is printed). Stops the whole session if this process is interrupted;
    the guard stops it if this process dies."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"\n[study] {time.strftime('%Y-%m-%d %H:%M:%S')} launching: {' '.join(cmd)}\n")
        log.flush()
        guarded = [sys.executable, "-m", "opd_patches.study.guard", str(os.getpid()), "--", *cmd]
        proc = subprocess.Popen(guarded, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if child_file is not None:
            receipts.atomic_write_json(child_file, {"pid": proc.pid, "sid": proc.pid, "cmd": cmd[:3]})
        try:
            while True:
                try:
                    code = proc.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if poll is not None and (line := poll()):
                    print(line, flush=True)
        except BaseException:
            stop_session(proc)
            raise
        guard.kill_session(proc.pid, timeout=10)  # the leader exited; helpers of its session go with it
    if poll is not None and (line := poll()):
        print(line, flush=True)
    return code


def shared_cores_env(env: dict) -> dict:
    """For a process that shares the machine's cores with other runs: one OpenMP/torch thread per process
    (unless the caller's environment sets it). Every process of a run spinning up as many threads as there
    are cores oversubscribes them: two evaluations side by side ran several times slower with a thread per
    core each than with one thread each (docs/bench/history.md)."""
    if "OMP_NUM_THREADS" not in os.environ:
        env = {**env, "OMP_NUM_THREADS": "1"}
    return env


def run_env(plan: RunPlan, shared_cores: bool = False) -> dict:
    env = {**os.environ, **plan.env, "OUTPUT_DIR": str(plan.run_dir), "PYTHONUNBUFFERED": "1"}
    env.setdefault("PYTHON", sys.executable)
    return shared_cores_env(env) if shared_cores else env


def launch(plan: RunPlan, progress, shared_cores: bool = False) -> int:
    """Launch (or resume) one run; returns run.sh's exit status. `shared_cores`: other runs or evaluations
    of the study run beside it (shared_cores_env; Ray's workers inherit the variable)."""
    check_identity(plan)
    check_no_leftover(plan)
    return run_child(plan.command(), run_env(plan, shared_cores), plan.run_dir / "run.log", plan.run_dir / CHILD,
                     progress.poll)
