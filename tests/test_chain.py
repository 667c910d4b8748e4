"""`make run` (opd_patches/study/chain.py): the deadline arithmetic, the refusal of changed inputs and the
stage-skip rule on their own, and (slow) one shared run of the whole chain on the known-answer task,
killed during training once its first state is complete, then started again with the same command:
the deadline stays the first launch's, training resumes from that state and completes, selection ranks
the exports and the report names the choice, its final score and the student's.
"""

import calendar
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from background import POOL, Spec, shared_run
from opd_patches.ops.budget import WallClock
from opd_patches.study import chain
from opd_patches.study import chain_record as record
from opd_patches.study import deadline as dl
from opd_patches.study.guard import session_pids

REPO = Path(__file__).resolve().parents[1]
# A cut of the selection that a CPU does in seconds: 4 questions, one sample each, on both halves.
SELECT = "--samples 1 --limit 4 --backend hf"
POLL_S = 0.2


# ---- the deadline ---------------------------------------------------------------------------------------
def test_the_deadline_is_fixed_at_the_first_launch_and_kept_by_later_ones():
    first = dl.fix_deadline(None, None, 3600, now=1000.0)
    assert first == {"deadline": 4600.0, "first_launch": 1000.0, "given": "WALL_CLOCK=3600"}
    assert dl.fix_deadline(first, None, 3600, now=2500.0) is first  # the same WALL_CLOCK counts from the first launch
    assert dl.fix_deadline(first, None, None, now=9000.0) is first
    with pytest.raises(dl.DeadlineError, match="fixed at the first launch .*--new-deadline"):
        dl.fix_deadline(first, None, 60, now=2500.0)
    assert dl.fix_deadline(None, None, None, now=1000.0) is None
    with pytest.raises(dl.DeadlineError, match="not both"):
        dl.fix_deadline(None, "1800000000", 60, now=1000.0)


def test_a_deadline_is_an_iso_time_or_epoch_seconds():
    assert dl.parse_time("1800000000") == 1800000000.0
    christmas = calendar.timegm((2026, 12, 24, 17, 0, 0))
    assert dl.parse_time("2026-12-24T18:00:00+01:00") == christmas == dl.parse_time("2026-12-24T17:00:00Z")
    with pytest.raises(dl.DeadlineError, match="DEADLINE=tomorrow: give an ISO 8601 time"):
        dl.parse_time("tomorrow")


def test_training_stops_at_the_deadline_minus_what_selection_needs():
    wall, reserve = dl.training_window(10_000.0, 600.0, now=4_000.0)
    assert (wall, reserve) == (6_000.0, 600.0)
    # the trainer's own rule (ops/budget.py) then ends training, final save included, by deadline - reserve
    assert WallClock(wall_clock_s=wall, reserve_s=reserve, launched_at=4_000.0).deadline == 9_400.0
    # a relaunch later in the day gets less wall clock for the same stop time
    wall2, _ = dl.training_window(10_000.0, 600.0, now=7_000.0)
    assert WallClock(wall_clock_s=wall2, reserve_s=600.0, launched_at=7_000.0).deadline == 9_400.0
    with pytest.raises(dl.DeadlineError, match="no time left to train"):
        dl.training_window(10_000.0, 600.0, now=9_500.0)


def test_the_estimate_counts_every_evaluation_at_its_token_cap():
    assert dl.kept_exports(keep=3, total_steps=2200, save_freq=20) == 4   # keep + the newest complete one
    assert dl.kept_exports(keep=10, total_steps=6, save_freq=2) == 3      # no more than the run saves
    assert dl.kept_exports(keep=10, total_steps=7, save_freq=2) == 4      # ... the last step included
    proxy = {"questions": 500, "samples": 4, "max_new_tokens": 12288}
    final = {"questions": 60, "samples": 32, "max_new_tokens": 31744}
    evals = dl.after_training(proxy, final, exports=4)
    assert [e.count for e in evals] == [4, 1, 1, 1]
    tokens = 5 * 500 * 4 * 12288 + 2 * 60 * 32 * 31744
    assert sum(e.tokens for e in evals) == tokens
    assert dl.seconds_needed(evals, 5000.0, 180.0) == pytest.approx(tokens / 5000.0 + 7 * 180.0 + dl.SLACK_S)


def test_a_measured_throughput_replaces_the_default(tmp_path):
    assert dl.throughput("cpu", [])["source"].startswith("default for cpu")
    fast, slow, partial = tmp_path / "fast.json", tmp_path / "slow.json", tmp_path / "cut.json"
    fast.write_text(json.dumps({"generated_this_run": 800, "mean_response_tokens": 20.0, "elapsed_s": 10.0}))
    slow.write_text(json.dumps({"generated_this_run": 100, "mean_response_tokens": 30.0, "elapsed_s": 10.0}))
    partial.write_text('{"generated_this_run": 8')
    rate = dl.throughput("gpu", [fast, slow, partial, tmp_path / "absent.json"])
    assert rate["tokens_per_s"] == 300.0 and str(slow) in rate["source"]  # the slowest: the reserve errs long
    assert rate["startup_s"] == dl.DEFAULT_STARTUP_S["gpu"]


# ---- inputs and stages ----------------------------------------------------------------------------------
def test_changed_inputs_are_refused_naming_each_difference(tmp_path):
    before = {"task": None, "student": "/m/s", "recipe": "topk", "overrides": ["trainer.save_freq=50"]}
    state = {"stages": {"preflight": {"inputs": {"task": None, "student": "/m/s"}},
                        "train": {"inputs": before}}}
    record.check_recorded(state, {"preflight": {"task": None, "student": "/m/s"}, "train": dict(before)}, tmp_path)
    now = {**before, "recipe": "k1", "overrides": ["trainer.save_freq=25"]}
    with pytest.raises(record.ChainError) as err:
        record.check_recorded(state, {"preflight": {"task": None, "student": "/m/s"}, "train": now}, tmp_path)
    msg = str(err.value)
    assert 'recipe: "topk" -> "k1"' in msg and 'overrides: ["trainer.save_freq=50"] -> ["trainer.save_freq=25"]' in msg
    assert str(tmp_path) in msg and "student" not in msg
    # cumulative inputs repeat a difference in every later stage: named once
    state["stages"]["select"] = {"inputs": {**before, "proxy": "math500"}}
    with pytest.raises(record.ChainError) as err:
        record.check_recorded(state, {"train": now, "select": {**now, "proxy": "math500"}}, tmp_path)
    assert str(err.value).count("recipe:") == 1
    assert record.differences({"a": 1}, {"b": 1}) == ['a: 1 -> "(unset)"', 'b: "(unset)" -> 1']


def test_a_stage_is_skipped_only_when_finished_with_the_same_inputs_and_its_result_is_there():
    inputs = {"task": "addition", "recipe": "topk"}
    done = {"inputs": dict(inputs), "finished_at": 1.0}
    assert record.decide(done, inputs, result_exists=True) == "skip"
    assert record.decide(done, inputs, result_exists=False) == "run"  # its result deleted: made again
    assert record.decide({**done, "finished_at": None}, inputs, True) == "run"  # killed in the middle: continued
    assert record.decide(None, inputs, True) == "run"


def test_arguments_are_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "run"
    cases = [(["--task", "addition", "--student", "s"], "TASK=addition brings its own models and data; STUDENT"),
             (["--student", "s", "--teacher", "t"], "DAPO not given"),
             (["--task", "addition", "--recipe", "nope"], "RECIPE=nope: no such recipe"),
             (["--task", "addition", "opd.wall_clock_s=60"], "override opd.wall_clock_s=60: the chain sets it"),
             (["--task", "addition", "--stage", "data"], "STAGE=data: choose one of preflight, train")]
    for argv, expected in cases:
        assert chain.main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("[run] error: ") and expected in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


# ---- the whole chain, killed and continued -----------------------------------------------------------------
def _argv(base: Path, *extra: str, wall_clock: str = "3600") -> list[str]:
    return [sys.executable, "-m", "opd_patches.study.chain", "--task", "addition", "--out", str(base / "run"),
            "--wall-clock", wall_clock, f"--select-args={SELECT} --cache {base / 'cache'}", *extra]


def _env(base: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OPD_CONFIG", "OPD_LOCK_HELD")}
    return {**env, "OPD_LOCK_DIR": str(base / "lock"), "PYTHONUNBUFFERED": "1"}


def _launch(base: Path, name: str, *extra: str) -> subprocess.Popen:
    with open(base / f"{name}.log", "w") as log:
        proc = subprocess.Popen(_argv(base, *extra), cwd=REPO, env=_env(base), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    POOL.track(proc)
    return proc


def _killed_and_continued(base: Path) -> dict:
    run = base / "run"
    first = _launch(base, "first")
    receipt, limit = None, time.monotonic() + 900
    while receipt is None and first.poll() is None and time.monotonic() < limit:
        receipt = next(iter(sorted((run / "train").glob("global_step_*/receipt.json"))), None)
        if receipt is None:
            time.sleep(POLL_S)  # the poll interval of the wait for the first complete state
    state_first = json.loads((run / "chain.json").read_text())
    first.send_signal(signal.SIGTERM)
    code_first = first.wait(300)
    child = json.loads((run / "train" / "study_child.json").read_text())
    left = session_pids(child["sid"])
    second = _launch(base, "second")
    code_second = second.wait(1500)
    return {"receipt": receipt, "code_first": code_first, "left": left, "state_first": state_first,
            "code_second": code_second, "first_log": (base / "first.log").read_text(errors="replace"),
            "second_log": (base / "second.log").read_text(errors="replace")}


chain_run = shared_run("chain_run", lambda out: Spec(fn=_killed_and_continued), cost=3)


@pytest.fixture(scope="module")
def continued(chain_run):
    v = chain_run.value
    assert v["code_second"] == 0, v["second_log"][-4000:]
    return {**v, "run": chain_run.out / "run", "base": chain_run.out}


@pytest.mark.slow
def test_a_kill_during_training_stops_the_tree_and_the_same_command_resumes_toward_the_same_deadline(continued):
    run, v = continued["run"], continued
    assert v["receipt"] is not None, v["first_log"][-3000:]
    assert v["code_first"] == 130 and "interrupted" in v["first_log"] and v["left"] == []
    state = json.loads((run / "chain.json").read_text())
    assert state["deadline"] == v["state_first"]["deadline"] and len(state["launches"]) == 2
    assert state["deadline"]["deadline"] == pytest.approx(state["launches"][0] + 3600)
    train = run / "train"
    # resumed, not restarted: the second launch's first logged step follows the state the first one completed
    saved = int(v["receipt"].parent.name.split("_")[-1])
    first_steps = [json.loads(line)["step"] for line in (train / "metrics.1.jsonl").read_text().splitlines() if line.strip()]
    second_steps = [json.loads(line)["step"] for line in (train / "metrics.jsonl").read_text().splitlines()]
    assert first_steps[0] == 1 and second_steps[0] > saved >= 2, (first_steps, second_steps)
    assert "[opd] resume: from the newest complete state" in (train / "run.log").read_text(errors="replace")
    summary = json.loads((train / "run_summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps_done"] == 6 == second_steps[-1]
    assert state["stages"]["train"]["launches"] == 2 and state["stages"]["train"]["finished_at"]
    assert "train: resuming" in v["second_log"] and "preflight: done for these inputs, skipped" in v["second_log"]
    # the wall clock handed to training ends it before the deadline by the estimate printed
    assert "estimate after training:" in v["second_log"] and "training stops by" in v["second_log"]
    manifest = json.loads((train / "manifest.json").read_text())["config"]["opd"]
    assert manifest["wall_clock_s"] <= state["deadline"]["deadline"] - state["launches"][1] + 1
    assert manifest["reserve_s"] == pytest.approx(state["estimates"][-1]["seconds"], abs=1)


@pytest.mark.slow
def test_the_report_holds_the_selection_the_final_score_and_the_environment(continued):
    run = continued["run"]
    sel = json.loads((run / "train" / "select" / "selection.json").read_text())
    assert [r["step"] for r in sel["ranking"]] == [2, 4, 6] and sel["chosen_step"] in (2, 4, 6)
    fin = sel["final"]
    assert fin["chosen"]["n_questions"] == fin["student"]["n_questions"] == 4
    assert fin["chosen_vs_student"]["n_common"] == 4 and math.isfinite(fin["chosen_vs_student"]["diff"])
    md = (run / "report.md").read_text()
    data = json.loads((run / "report.json").read_text())
    assert "## Selection" in md and "**chosen**" in md and "| 6 | " in md
    c, s = fin["chosen"], fin["student"]
    assert f"pass@1 {c['pass_at_1']:.3f}" in md and f"the student: {s['pass_at_1']:.3f}" in md
    assert "paired by question" in md
    assert data["environment"]["packages"]["torch"] and data["environment"]["git"]["commit"]
    assert data["composed"]["trainer.save_freq"] == 2 and data["composed"]["trainer.total_training_steps"] == 6
    assert data["curves"]["steps"] == [1, 2, 3, 4, 5, 6]
    assert (run / "report" / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](report/training_curves.png)" in md
    assert {s["stage"] for s in data["stages"]} >= {"preflight", "train", "select", "final"}
    files = data["data"]["files"]
    assert len(files) == 2 and all(len(sha) == 64 for sha in files.values())


@pytest.mark.slow
def test_the_same_command_then_skips_every_stage_and_other_inputs_are_refused(continued):
    base, run = continued["base"], continued["run"]
    before = {p: p.stat().st_mtime_ns for p in (run / "train").rglob("generations.jsonl")}
    again = subprocess.run(_argv(base), cwd=REPO, env=_env(base), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for stage in ("preflight", "train", "select", "final"):
        assert f"{stage}: done for these inputs, skipped" in again.stdout
    assert "evaluating" not in again.stdout and {p: p.stat().st_mtime_ns for p in before} == before
    changed = subprocess.run(_argv(base, "--recipe", "k1", "trainer.save_freq=3"), cwd=REPO, env=_env(base),
                             capture_output=True, text=True, timeout=600)
    assert changed.returncode == 2 and len(changed.stderr.strip().splitlines()) == 1, changed.stderr
    assert 'recipe: "topk" -> "k1"' in changed.stderr and '"trainer.save_freq=3"' in changed.stderr
    later = subprocess.run(_argv(base, wall_clock="60"), cwd=REPO, env=_env(base),
                           capture_output=True, text=True, timeout=600)
    assert later.returncode == 2 and "the deadline was fixed at the first launch" in later.stderr


# ---- the data stages of the real path, on small local files ---------------------------------------------
@pytest.mark.slow
def test_the_data_stages_decontaminate_and_a_changed_dapo_file_is_refused(tmp_path, embedded):
    """data-eval, data and preflight of the researcher's path, each run alone (STAGE=), on local files: a
    training problem that is also an evaluation problem is removed, the report gives each file's sha256."""
    shared = "Compute the value of 7 times 8 plus the square root of 81."
    rows = [{"problem": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(20)]
    dapo = tmp_path / "dapo.jsonl"
    dapo.write_text("".join(json.dumps(r) + "\n" for r in [*rows, {"problem": shared, "answer": "65"}]))
    sets = {"math500": [{"id": "m1", "problem": shared, "answer": "65"}],
            "aime24": [{"id": "a1", "problem": "Find the remainder when 2^10 is divided by 7.", "answer": "2"}],
            "aime25": [{"id": "b1", "problem": "Find the number of divisors of 360.", "answer": "24"}]}
    for name, items in sets.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "opd_patches.study.chain", "--student", str(embedded["student"]), "--teacher",
            str(embedded["teacher"]), "--dapo", str(dapo), "--out", str(out),
            "--eval-sets", " ".join(f"{n}={tmp_path / n}.jsonl" for n in sets)]

    def chain_(stage):
        return subprocess.run([*argv, "--stage", stage], cwd=REPO, env=_env(tmp_path), capture_output=True, text=True,
                              timeout=600)

    early = chain_("data")
    assert early.returncode == 2 and "STAGE=data needs stage data-eval done first" in early.stderr
    for stage in ("data-eval", "data", "preflight", "report"):
        done = chain_(stage)
        assert done.returncode == 0 and f"{stage}: done" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    counts = json.loads((out / "data" / "data_report.json").read_text())["counts"]
    assert counts["read"] == 21 and counts["decontaminated"] == counts["train"] == 20
    assert json.loads((out / "preflight.json").read_text())["ok"] is True
    md = (out / "report.md").read_text()
    assert f"| `{dapo}` | `{chain.receipts.sha256(dapo)}` |" in md and "1 by decontamination" in md
    assert "data: done for these inputs, skipped" in chain_("data").stdout  # done: not made again
    dapo.write_text(dapo.read_text() + json.dumps({"problem": "One more?", "answer": "1"}) + "\n")
    changed = chain_("report")
    assert changed.returncode == 2 and "dapo_sha256: " in changed.stderr and "would mix" in changed.stderr
