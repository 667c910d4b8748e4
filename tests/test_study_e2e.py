"""A tiny study end to end from one command (`make study SPEC=... OUT=...`): recipes/studies/smoke.yaml
with its first seed only (2 arms (k1, topk) x 1 seed x 2 real training steps on the embedded models: each
launch costs about a minute of start-up, and the seed loop and pooling are tested in test_study.py), then
3 MATH-500 questions x 2 samples x 16 tokens on each run's last checkpoint, then the report.

One study is shared by every assertion: it is killed (SIGTERM to its process group, as a terminal's
Ctrl-C or a scheduler would) once the first run is complete and the second has started; relaunched, it
is killed again with SIGKILL (no clean-up of its own) once the second run's Ray is up again: the guard of
that run (opd_patches/study/guard.py) must take down every process of the training. Then the same
command is run to the end: the complete run must be skipped (never relaunched), the second resumed,
trained, both evaluated and reported. Questions come from tests/real_problems.py's folder (skipped where absent).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from background import Spec, shared_run
from opd_patches.ops import checkpoints
from opd_patches.study import runner

from real_problems import DATA, missing
from test_study_guard import wait_gone

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
SPEC = REPO / "recipes" / "studies" / "smoke.yaml"
SEED = yaml.safe_load(SPEC.read_text())["seeds"][0]
RUNS = [("k1", SEED), ("topk", SEED)]
pytestmark = pytest.mark.slow


def _wait_up(proc, child_file: Path, timeout: float, since: float = 0.0) -> bool:
    """Wait until `child_file`'s run, launched after `since` (time.time()), has been up for a while (Ray
    started); False if the study ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if child_file.exists() and since < child_file.stat().st_mtime < time.time() - 25:
            break
        time.sleep(2)
    return proc.poll() is None


def _wait_session_empty(sid: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := runner.session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(1)
    return left


def _study(base):
    """The study, killed twice and finished (a shared run, tests/background.py: in a thread beside the rest)."""
    if not (DATA / "math500.jsonl").exists():
        return None  # the fixture skips
    out = base / "smoke"
    spec = yaml.safe_load(SPEC.read_text())
    spec["seeds"] = [SEED]
    (base / "smoke.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {**os.environ, "OPD_EVAL_DATA": str(DATA), "OPD_LOCK_DIR": str(base / "lock")}
    cmd = ["make", "-s", "study", "PREPARED=1", f"PY={sys.executable}", f"SPEC={base / 'smoke.yaml'}", f"OUT={out}"]
    first_log = out.parent / "first.log"
    run = {name: out / "runs" / name[0] / f"seed{name[1]}" for name in RUNS}
    seen = {}
    with open(first_log, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # kill once run 1 is complete and run 2's process tree has been up for a while (Ray started)
        seen["first_still_running"] = _wait_up(proc, run[RUNS[1]] / runner.CHILD, 900)
        os.killpg(proc.pid, signal.SIGTERM)
        seen["run1_at_kill"] = [(s["step"], s["complete"]) for s in checkpoints.list_states(run[RUNS[0]])]
        proc.wait(timeout=60)
        seen["study_left"] = _wait_session_empty(proc.pid, 90)  # the study stops its run, then exits
        child = json.loads((run[RUNS[1]] / runner.CHILD).read_text())
        seen["run2_left"] = _wait_session_empty(child["sid"], 30)
        for pid in seen["study_left"] + seen["run2_left"]:  # never leave a stray tree behind a failed assertion
            os.kill(pid, signal.SIGKILL)
    second_log = out.parent / "second.log"
    with open(second_log, "w") as log:  # SIGKILL (make and the study at once) while run 2 trains again
        since = time.time()  # run 2's child file is the first launch's until the study relaunches it
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        child_file = run[RUNS[1]] / runner.CHILD
        running = _wait_up(proc, child_file, 1200, since)
        sid = json.loads(child_file.read_text())["sid"] if child_file.exists() else None
        tree = sorted({sid, *runner.session_pids(sid)}) if sid else []  # the guard and its session
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        seen.update(second_still_running=running, killed_tree=tree, killed_left=wait_gone(tree, 90))
        for pid in seen["killed_left"]:
            os.kill(pid, signal.SIGKILL)
    last = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    (out.parent / "last.log").write_text(last.stdout + last.stderr)  # for a failed assertion's reader
    return {"out": out, "run": run, "first": first_log.read_text(), "second": second_log.read_text(),
            "last": last, "seen": seen}


study_run = shared_run("study_run", lambda base: Spec(fn=_study), cost=4)


@pytest.fixture(scope="module")
def study(study_run):
    if not (DATA / "math500.jsonl").exists():
        pytest.skip(missing(DATA / "math500.jsonl"))
    return study_run.value


def test_kill_stops_the_study_and_its_run(study):
    seen, first = study["seen"], study["first"]
    assert seen["first_still_running"], first
    assert seen["study_left"] == [] and seen["run2_left"] == [], seen  # no training process outlives the kill
    assert "interrupted" in first and "the same command resumes" in first, first
    assert "start: 2 arms x 1 seeds = 2 runs: 0 complete" in first
    # progress lines of the first run: step, elapsed, ETA
    assert f"[study] run 1/2 k1 seed {SEED}: step 2/2, elapsed" in first and " s/step, eta " in first, first
    assert f"run 2/2 topk seed {SEED}: starting" in first, first
    assert (2, True) in seen["run1_at_kill"]


def test_sigkill_of_the_study_stops_its_run(study):
    seen, second = study["seen"], study["second"]
    assert seen["second_still_running"], second
    assert "start: 2 arms x 1 seeds = 2 runs: 1 complete" in second, second
    assert f"run 1/2 k1 seed {SEED}: complete" in second and f"run 2/2 topk seed {SEED}: resuming" in second, second
    # The guard and run.sh's python at least (Ray's processes too when the kill lands after its start-up,
    # which depends on the machine's load); whichever were there, none may survive.
    assert len(seen["killed_tree"]) >= 2, seen
    assert seen["killed_left"] == [], seen  # none outlives the SIGKILLed study


def test_resume_skips_the_complete_runs(study):
    last, run = study["last"], study["run"]
    assert last.returncode == 0, last.stdout[-4000:] + last.stderr[-4000:]
    out = last.stdout
    assert "start: 2 arms x 1 seeds = 2 runs: 1 complete" in out, out
    assert f"run 1/2 k1 seed {SEED}: complete (finished after step 2" in out and "skipped" in out
    assert f"run 2/2 topk seed {SEED}: resuming" in out
    first = json.loads((run[RUNS[0]] / "study_result.json").read_text())
    assert first["launches"] == 1 and not (run[RUNS[0]] / "metrics.1.jsonl").exists()  # never relaunched
    # run 2: interrupted by the SIGTERM (recorded), SIGKILLed (the study had no chance to record), finished
    assert json.loads((run[RUNS[1]] / "study_result.json").read_text())["launches"] == 2
    assert "end: 2 arms x 1 seeds = 2 runs: 2 complete" in out


def test_every_run_trained_and_evaluated(study):
    out_dir = study["out"]
    for arm, seed in RUNS:
        run = study["run"][(arm, seed)]
        summary = json.loads((run / "run_summary.json").read_text())
        assert summary["status"] == "finished" and summary["last_complete_step"] == 2, (arm, seed, summary)
        config = json.loads((run / "manifest.json").read_text())["config"]  # the seed keys reached the trainer
        assert config["data"]["seed"] == seed and config["actor_rollout_ref"]["rollout"]["seed"] == seed
        assert config["actor_rollout_ref"]["actor"]["data_loader_seed"] == seed
        s = json.loads((out_dir / "evals" / arm / f"seed{seed}" / "global_step_2" / "math500" / "summary.json").read_text())
        assert s["complete"] and (s["n_questions"], s["n_samples"]) == (3, 6) and s["step"] == 2


def test_report_table_and_chart(study):
    out_dir = study["out"]
    md = (out_dir / "report.md").read_text()
    assert "| arm | pass@1 | SE | per seed | seed std | diff vs k1 | SE diff | p | verdict |" in md, md
    assert "| k1 | " in md and "| topk | " in md and "## math500, checkpoint last" in md
    assert "topk vs k1: " in md and ("within noise" in md or "is better than" in md)
    assert (out_dir / "report.png").read_bytes()[:8] == PNG
    data = json.loads((out_dir / "report.json").read_text())
    [group] = data["groups"]
    assert set(group["arms"]) == {"k1", "topk"} and set(group["arms"]["k1"]["per_seed"]) == {str(SEED)}
    assert group["diffs"]["topk"]["n_common"] == 3
    assert "report: " in study["last"].stdout
