"""Studies, the fast parts: spec validation (errors name the key), the run plan (seed keys last, budget),
run completeness from run_summary + receipts, progress ETA, and the report's statistics against a
hand-computed case (pooled pass@1, clustered SE, seed spread, paired difference, p, "within noise")
written as report.md / report.json / report.png.
"""

import json
import math
from pathlib import Path

import pytest

from opd_patches.ops import receipts
from opd_patches.ops import run_summary
from opd_patches.study import evaluate, report, runner
from opd_patches.study.progress import RunProgress, read_steps
from opd_patches.study.spec import SEED_KEYS, Arm, Spec, SpecError, load

PNG = b"\x89PNG\r\n\x1a\n"
GOOD = {
    "recipe": "k1",
    "env": {"EMBEDDED": 1},
    "overrides": ["+overlay=smoke"],
    "arms": {"k1": [], "topk": ["recipe=topk", "data.seed=7"]},
    "seeds": [1, 2],
    "budget": {"steps": 2},
    "eval": {"suites": ["math500"], "limit": 3, "samples": 2, "max_new_tokens": 16},
}


def write_spec(tmp_path, data, name="s.yaml"):
    import yaml

    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_spec_loads_and_plans_runs(tmp_path):
    spec = load(write_spec(tmp_path, GOOD))
    assert spec.name == "s" and spec.control == "k1" and [a.name for a in spec.arms] == ["k1", "topk"]
    assert spec.arm("topk").recipe == "topk" and spec.arm("topk").overrides == ["data.seed=7"]
    assert spec.env == {"EMBEDDED": "1"} and spec.eval["checkpoints"] == "last" and spec.eval["backend"] == "auto"
    assert any("data.seed=7" in w for w in spec.warnings)  # the study seed replaces it
    plans = runner.plan_runs(spec, tmp_path / "out")
    assert [(p.arm, p.seed) for p in plans] == [("k1", 1), ("k1", 2), ("topk", 1), ("topk", 2)]
    p = plans[3]
    assert p.run_dir == tmp_path / "out" / "runs" / "topk" / "seed2"
    cmd = p.command()
    assert cmd[1] == "recipe=topk" and "+overlay=smoke" in cmd and "trainer.total_training_steps=2" in cmd
    # the seed keys come last, after the arm's own data.seed=7, so the study seed wins
    assert cmd[-len(SEED_KEYS):] == [f"{k}=2" for k in SEED_KEYS]
    assert cmd.index("data.seed=7") < cmd.index("data.seed=2")
    assert "trainer.total_training_steps=2" not in p.identity()["overrides"]  # a longer budget resumes
    other = runner.plan_runs(load(write_spec(tmp_path, GOOD, name="other.yaml")), tmp_path / "out")
    assert other[3].command() != p.command() and other[3].identity() == p.identity()  # the same run, another study


def test_shipped_smoke_spec_plans_two_arms_by_two_seeds(tmp_path, capsys):
    """`make study SPEC=recipes/studies/smoke.yaml` as documented (test_study_e2e.py runs it with one seed)."""
    from opd_patches.study.cli import main

    path = Path(__file__).resolve().parents[1] / "recipes" / "studies" / "smoke.yaml"
    assert main([str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    assert "start: 2 arms x 2 seeds = 4 runs: 0 complete" in capsys.readouterr().out
    assert load(path).eval["backend"] == "hf"


@pytest.mark.parametrize("change, key", [
    ({"colour": 1}, "`colour`"),
    ({"recipe": "nope"}, "`recipe`"),
    ({"arms": {"k1": [], "bad": ["recipe=nope"]}}, "`arms.bad`"),
    ({"arms": {"k1": ["not an override"]}}, "`arms.k1`"),
    ({"arms": {"k 1": []}}, "`arms.k 1`"),
    ({"arms": {"k1": ["trainer.default_local_dir=/x"]}}, "`arms.k1`"),
    ({"control": "zz"}, "`control`"),
    ({"seeds": []}, "`seeds`"),
    ({"seeds": [1, 1]}, "`seeds`"),
    ({"budget": {}}, "`budget`"),
    ({"budget": {"steps": 0}}, "`budget.steps`"),
    ({"budget": {"step": 2}}, "`budget.step`"),
    ({"eval": {"suites": ["nope"]}}, "`eval.suites`"),
    ({"eval": {"suites": ["math500"], "checkpoints": "first"}}, "`eval.checkpoints`"),
    ({"eval": {"suites": ["math500"], "limit": -1}}, "`eval.limit`"),
    ({"eval": {"suites": ["math500"], "backend": "tgi"}}, "`eval.backend`"),
    ({"env": {"OUTPUT_DIR": "/x"}}, "`env.OUTPUT_DIR`"),
    ({"ablate": {"control": "k1", "treatment": "topk"}}, "`ablate`"),  # together with arms
])
def test_spec_errors_name_the_key(tmp_path, change, key):
    path = write_spec(tmp_path, {**GOOD, **change})
    with pytest.raises(SpecError) as err:
        load(path)
    assert str(err.value).startswith(f"{path}: {key}:"), str(err.value)


def test_spec_missing_sections(tmp_path):
    for missing in ("budget", "eval", "seeds"):
        data = {k: v for k, v in GOOD.items() if k != missing}
        with pytest.raises(SpecError, match=f"`{missing}`"):
            load(write_spec(tmp_path, data))


def _fake_state(run_dir: Path, step: int):
    state = run_dir / f"global_step_{step}"
    (state / "actor" / "huggingface").mkdir(parents=True)
    (state / "actor" / "huggingface" / "config.json").write_text("{}")
    receipts.write(state, step, {"ok": True, "checks": {}, "error": None})


def test_run_status_from_summary_and_receipts(tmp_path):
    spec = load(write_spec(tmp_path, GOOD))
    plan = runner.plan_runs(spec, tmp_path / "out")[0]
    assert runner.status(plan, spec.budget)["state"] == "new"
    _fake_state(plan.run_dir, 1)
    assert runner.status(plan, spec.budget)["state"] == "partial"  # killed: no run_summary.json
    run_summary.write(plan.run_dir, "finished", 1, "reached 1")
    st = runner.status(plan, spec.budget)
    assert st["state"] == "partial" and "budget now 2" in st["detail"]  # fewer steps than the budget
    _fake_state(plan.run_dir, 2)
    run_summary.write(plan.run_dir, "finished", 2, "reached 2")
    assert runner.status(plan, spec.budget)["state"] == "complete"
    run_summary.write(plan.run_dir, "non_finite", 2, "nan loss")
    assert runner.status(plan, spec.budget)["state"] == "failed"
    # identity: the same settings pass, other settings for the same folder are refused
    runner.check_identity(plan)
    runner.check_identity(plan)
    written = json.loads((plan.run_dir / runner.IDENTITY).read_text())  # one that lists the name and the budget
    (plan.run_dir / runner.IDENTITY).write_text(json.dumps({**written, "overrides": plan.overrides}))
    runner.check_identity(plan)
    plan.overrides.append("actor_rollout_ref.actor.optim.lr=1")
    with pytest.raises(runner.StudyError, match="other settings"):
        runner.check_identity(plan)


def test_eval_jobs_pick_checkpoints(tmp_path):
    spec = load(write_spec(tmp_path, GOOD))
    plan = runner.plan_runs(spec, tmp_path / "out")[0]
    for step in (1, 2, 3):
        _fake_state(plan.run_dir, step)
    out = tmp_path / "out"
    [last] = evaluate.jobs_for(plan, spec.eval, out)
    assert (last.label, last.step) == ("last", 3)
    assert last.model == (plan.run_dir / "global_step_3" / "actor" / "huggingface").resolve()
    assert last.out == out / "evals" / "k1" / "seed1" / "global_step_3" / "math500"
    every = evaluate.jobs_for(plan, {**spec.eval, "checkpoints": "every"}, out)
    assert [j.label for j in every] == ["step 1", "step 2", "step 3"]
    listed = evaluate.jobs_for(plan, {**spec.eval, "checkpoints": [2, 5]}, out)
    assert not listed[0].missing and "step 5 is not a complete state" in listed[1].missing
    cmd = evaluate.command(last, spec.eval)
    assert cmd[cmd.index("--limit") + 1] == "3" and cmd[cmd.index("--samples") + 1] == "2" and "--temperature" not in cmd


def test_progress_eta_from_metrics(tmp_path):
    now = [0.0]
    prog = RunProgress(tmp_path, "run 1/2 k1 seed 1", total_steps=10, clock=lambda: now[0], heartbeat_s=30)
    assert prog.poll() is None
    now[0] = 31.0
    assert "starting" in prog.poll()  # heartbeat before the first step
    metrics = tmp_path / "metrics.jsonl"

    def log_step(step, t):
        now[0] = t
        with open(metrics, "a") as fh:
            fh.write(json.dumps({"step": step, "data": {"timing_s/step": 40.0}}) + "\n")
        return prog.poll()

    line = log_step(1, 50.0)
    assert "step 1/10" in line and "40.0 s/step" in line and "eta 6m00s" in line  # 9 x step 1's own time
    log_step(2, 60.0)
    line = log_step(3, 70.0)
    assert "10.0 s/step" in line and "eta 1m10s" in line  # measured between steps: 7 left x 10 s
    now[0] = 80.0
    with open(metrics, "a") as fh:  # two steps logged between polls: the rate stays the measured one
        fh.write("".join(json.dumps({"step": s, "data": {"timing_s/step": 40.0}}) + "\n" for s in (4, 5)))
    assert "step 5/10" in prog.poll() and "7.5 s/step" in prog.line()  # (80 - 50) s / (5 - 1) steps
    with open(metrics, "a") as fh:
        fh.write('{"step": 6, "da')  # a line still being written is not read
    assert read_steps(metrics, prog.offset) == ([], prog.offset)


def test_progress_first_poll_reads_two_steps(tmp_path):
    # a fast run logs steps 1 and 2 before the study looks: the rate is step 1's own, not 0 s/step
    now = [0.0]
    prog = RunProgress(tmp_path, "run 1/2 k1 seed 1", total_steps=2, clock=lambda: now[0])
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "data": {"timing_s/step": 12.0}}) + "\n" for s in (1, 2)))
    now[0] = 30.0
    line = prog.poll()
    assert "step 2/2" in line and "12.0 s/step" in line and "eta 0 s" in line, line


# ---- statistics against a hand-computed case --------------------------------------------------------------
# 4 questions x 2 samples x 2 seeds per arm.
CONTROL = {1: {"q1": [1, 1], "q2": [0, 0], "q3": [1, 0], "q4": [0, 0]},
           2: {"q1": [1, 0], "q2": [0, 0], "q3": [1, 1], "q4": [0, 0]}}
TREAT = {1: {"q1": [1, 1], "q2": [1, 0], "q3": [1, 1], "q4": [0, 0]},
         2: {"q1": [1, 1], "q2": [1, 1], "q3": [1, 0], "q4": [1, 0]}}


def _write_eval(folder: Path, results: dict, kl: dict | None = None):
    folder.mkdir(parents=True)
    with open(folder / "generations.jsonl", "w") as fh:
        for q, outs in results.items():
            for k, o in enumerate(outs):
                fh.write(json.dumps({"id": q, "sample": k, "correct": bool(o), "truncated": False}) + "\n")
    summary = {"complete": True, "protocol": {"samples": 2}}
    if kl:  # as eval/teacher_kl.py writes it (the overall figure here: the mean of the questions')
        summary["teacher_kl"] = {"teacher_kl": sum(kl.values()) / len(kl), "per_question": kl}
    (folder / "summary.json").write_text(json.dumps(summary))


def _study(tmp_path, arms_results: dict, arms_kl: dict | None = None):
    spec = Spec(path=tmp_path / "s.yaml", name="hand", recipe="k1", env={}, overrides=[],
                arms=[Arm(a, a, []) for a in arms_results], control="k1", seeds=[1, 2], budget={"steps": 2},
                eval={"suites": ["math500"], "checkpoints": "last"})
    plans = runner.plan_runs(spec, tmp_path)
    jobs = []
    for p in plans:
        job = evaluate.EvalJob(p, "last", 2, "math500", tmp_path / "evals" / p.arm / f"seed{p.seed}", None)
        _write_eval(job.out, arms_results[p.arm][p.seed], (arms_kl or {}).get(p.arm, {}).get(p.seed))
        p.result = {"state": "complete", "detail": "hand-made"}
        jobs.append(job)
    return spec, plans, jobs


def test_report_statistics_hand_computed(tmp_path):
    spec, plans, jobs = _study(tmp_path, {"k1": CONTROL, "topk": TREAT})
    data = report.build(spec, plans, jobs, {})
    [g] = data["groups"]
    k1, topk = g["arms"]["k1"], g["arms"]["topk"]
    # pooled per question: control (.75, 0, .75, 0), treatment (1, .75, .75, .25)
    assert k1["pass_at_1"] == pytest.approx(0.375) and topk["pass_at_1"] == pytest.approx(0.6875)
    assert k1["se"] == pytest.approx(math.sqrt(0.1875) / 2)  # sd of (.75, 0, .75, 0) / sqrt(4)
    assert topk["se"] == pytest.approx(math.sqrt(0.296875 / 3) / 2)  # deviations (.3125, .0625, .0625, -.4375)
    assert k1["per_seed"] == {"1": 0.375, "2": 0.375} and k1["seed_std"] == pytest.approx(0.0)
    assert topk["per_seed"] == {"1": 0.625, "2": 0.75} and topk["seed_std"] == pytest.approx(0.125 / math.sqrt(2))
    d = g["diffs"]["topk"]
    # per-question differences (.25, .75, 0, .25): mean .3125, sd sqrt(0.296875 / 3), SE = sd / 2
    se = math.sqrt(0.296875 / 3) / 2
    assert d["diff"] == pytest.approx(0.3125) and d["se"] == pytest.approx(se) and d["n_common"] == 4
    theta = math.atan(0.3125 / se / math.sqrt(3))  # Student t, 3 dof: P(|T| < t) = (2/pi)(theta + sin cos)
    assert d["p_value"] == pytest.approx(1 - (2 / math.pi) * (theta + math.sin(theta) * math.cos(theta)), abs=1e-9)
    assert d["p_value"] == pytest.approx(0.1413, abs=1e-3) and d["verdict"].startswith("within noise")
    paths = report.write(tmp_path, data)
    md = paths["md"].read_text()
    assert "| topk | 0.688 | 0.157 | 1: 0.625, 2: 0.750 | 0.088 | +0.312 | 0.157 | 0.141 | within noise |" in md, md
    assert "topk vs k1: within noise" in md and "![pass@1 per arm](report.png)" in md
    assert paths["png"].read_bytes()[:8] == PNG
    saved = json.loads(paths["json"].read_text())
    assert saved["groups"][0]["diffs"]["topk"]["diff"] == pytest.approx(0.3125)
    assert "pooled_results" not in saved["groups"][0]["arms"]["k1"]


def test_report_names_a_clear_difference(tmp_path):
    qs = [f"q{i}" for i in range(12)]
    wrong = {s: {q: [0, 0] for q in qs} for s in (1, 2)}
    right = {s: {q: [1, 1] if i < 10 else [0, 0] for i, q in enumerate(qs)} for s in (1, 2)}
    spec, plans, jobs = _study(tmp_path, {"k1": wrong, "topk": right})
    d = report.build(spec, plans, jobs, {})["groups"][0]["diffs"]["topk"]
    assert d["diff"] == pytest.approx(10 / 12) and d["p_value"] < 1e-4
    assert d["verdict"].startswith("topk is better than k1")


def test_report_pairs_the_teacher_kl_by_question_against_the_control(tmp_path):
    """Per question the seeds' means are averaged, then differenced against the control's (lower is closer)."""
    kl = {"k1": {1: {"q1": 2.4, "q2": 0.2, "q3": 0.3, "q4": 0.1}, 2: {"q1": 2.2, "q2": 0.2, "q3": 0.5, "q4": 0.1}},
          "topk": {1: {"q1": 2.1, "q2": 0.2, "q3": 0.2, "q4": 0.1}, 2: {"q1": 2.1, "q2": 0.0, "q3": 0.2, "q4": 0.1}}}
    spec, plans, jobs = _study(tmp_path, {"k1": CONTROL, "topk": TREAT}, kl)
    data = report.build(spec, plans, jobs, {})
    d = data["groups"][0]["diffs"]["topk"]["teacher_kl"]
    diffs = [2.1 - 2.3, 0.1 - 0.2, 0.2 - 0.4, 0.1 - 0.1]  # per question: treatment mean - control mean (nats: > 1 too)
    mean = sum(diffs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 3)
    assert d["diff"] == pytest.approx(mean) and d["se"] == pytest.approx(sd / 2) and d["n_common"] == 4
    md = report.write(tmp_path, data)["md"].read_text()
    assert f"topk vs k1, teacher-KL (lower is closer to the teacher): {mean:+.4f}, SE {sd / 2:.4f}" in md, md
    plain = report.build(*_study(tmp_path / "plain", {"k1": CONTROL, "topk": TREAT}), {})
    assert "teacher_kl" not in plain["groups"][0]["diffs"]["topk"]  # no KL measured: no KL difference
    # a seed whose summary has no per-question values: the others pair; none at all in the control: said so
    spec, plans, jobs = _study(tmp_path / "part", {"k1": CONTROL, "topk": TREAT}, kl)
    for job in jobs:
        if job.plan.seed == 2:
            summary = json.loads((job.out / "summary.json").read_text())
            del summary["teacher_kl"]["per_question"]
            (job.out / "summary.json").write_text(json.dumps(summary))
    d = report.build(spec, plans, jobs, {})["groups"][0]["diffs"]["topk"]["teacher_kl"]
    assert d["diff"] == pytest.approx((-0.3 + 0.0 - 0.1 + 0.0) / 4) and d["n_common"] == 4  # seed 1 alone
    for job in jobs:
        summary = json.loads((job.out / "summary.json").read_text())
        summary["teacher_kl"].pop("per_question", None)
        (job.out / "summary.json").write_text(json.dumps(summary))
    data = report.build(spec, plans, jobs, {})
    assert "per-question" in data["groups"][0]["diffs"]["topk"]["teacher_kl"]["missing"]
    assert "teacher-KL (lower is closer to the teacher): not paired" in report.write(tmp_path / "part", data)["md"].read_text()


def test_cli_dry_run_and_spec_error(tmp_path, capsys):
    from opd_patches.study.cli import main

    out = tmp_path / "out"
    assert main([str(write_spec(tmp_path, GOOD)), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "start: 2 arms x 2 seeds = 4 runs: 0 complete, 0 failed (non-finite), 4 to run" in text
    assert f"topk seed 2 [new]: EMBEDDED=1 OUTPUT_DIR={out / 'runs' / 'topk' / 'seed2'} " in text
    assert json.loads((out / "study.json").read_text())["runs"][0]["command"][1] == "recipe=k1"
    assert not (out / "runs").exists()  # nothing ran
    assert main([str(write_spec(tmp_path, {**GOOD, "seeds": "x"}, "bad.yaml")), "--dry-run"]) == 2
    assert "`seeds`" in capsys.readouterr().err


@pytest.mark.parametrize("checkpoints", ["every", "last"])
def test_evaluations_during_training_follow_the_saves(tmp_path, monkeypatch, checkpoints):
    """eval.during_training: the references first, then each state as its receipt appears (`last`: only once
    the run is complete); nothing twice; finish() waits for the one running and starts nothing new."""
    import threading
    import time

    from opd_patches.study import cli

    student = tmp_path / "student"
    student.mkdir()
    data = {**GOOD, "arms": {"k1": []}, "seeds": [1], "references": {"student": str(student)},
            "eval": {**GOOD["eval"], "checkpoints": checkpoints, "during_training": True}}
    spec = load(write_spec(tmp_path, data))
    assert load(write_spec(tmp_path, {**GOOD}, "plain.yaml")).eval["during_training"] is False
    with pytest.raises(SpecError, match="eval.during_training"):
        load(write_spec(tmp_path, {**GOOD, "eval": {**GOOD["eval"], "during_training": "yes"}}, "bad.yaml"))
    [plan] = runner.plan_runs(spec, tmp_path / "out")
    ran, gate = [], threading.Semaphore(0)

    def fake_run_job(job, eval_spec, shared_cores=False):
        assert shared_cores
        ran.append(job.label if job.plan is None else job.step)
        gate.release()
        return {"state": "done", "detail": "", "seconds": 0.0}

    monkeypatch.setattr(cli.evaluate, "run_job", fake_run_job)
    monkeypatch.setattr(cli.runner, "POLL_S", 0.01)
    during = cli.DuringTraining(spec, [plan], tmp_path / "out").start()
    assert gate.acquire(timeout=10) and ran == ["reference"]
    _fake_state(plan.run_dir, 1)
    if checkpoints == "every":
        assert gate.acquire(timeout=10) and ran == ["reference", 1]
    _fake_state(plan.run_dir, 2)
    time.sleep(0.2)
    if checkpoints == "last":
        assert ran == ["reference"]  # the run is not complete: its last state is not known yet
        run_summary.write(plan.run_dir, "finished", 2, "reached 2")
    assert gate.acquire(timeout=10)
    time.sleep(0.2)
    during.finish()
    assert ran == (["reference", 1, 2] if checkpoints == "every" else ["reference", 2])
    assert not during.thread.is_alive()


def test_parallel_training_runs_side_by_side_in_plan_order(tmp_path, monkeypatch):
    """`parallel: 2`: at most two launches at once, started in plan order, each once the one before it has
    logged step 1; a complete run is skipped; a StudyError in one run stops handing out the rest and
    reaches the caller."""
    import threading
    import time

    from opd_patches.study import cli

    spec = load(write_spec(tmp_path, {**GOOD, "parallel": 2, "arms": {"a": [], "b": [], "c": []}, "seeds": [1]}))
    assert spec.parallel == 2 and load(write_spec(tmp_path, GOOD, "one.yaml")).parallel == 1
    with pytest.raises(SpecError, match="parallel"):
        load(write_spec(tmp_path, {**GOOD, "parallel": 0}, "zero.yaml"))
    plans = runner.plan_runs(spec, tmp_path / "out")
    done = {plans[0].run_dir}
    started, logged, live, peak, lock = [], [], [0], [0], threading.Lock()
    monkeypatch.setattr(cli.runner, "status", lambda p, b: {"state": "complete" if p.run_dir in done else "new",
                                                            "detail": "", "last_step": None})

    def fake_launch(plan, progress, shared_cores=False):
        assert shared_cores  # two runs side by side: one thread per process
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        with lock:
            assert live[0] == 0 or logged, "started before the previous run logged a step"
            started.append(plan.arm)
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.1)
        (plan.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {}}) + "\n")
        with lock:
            logged.append(plan.arm)
            progress.poll()  # what run_child does every POLL_S
        time.sleep(0.3)
        with lock:
            live[0] -= 1
        return 0

    monkeypatch.setattr(cli.runner, "launch", fake_launch)
    plans.append(runner.plan_runs(load(write_spec(tmp_path, {**GOOD, "arms": {"d": []}, "seeds": [1]}, "d.yaml")),
                                  tmp_path / "out")[0])
    cli.train(spec, plans, retry_failed=False, parallel=2)
    assert started == ["b", "c", "d"] and peak[0] == 2  # a was complete

    def failing(plan, progress, shared_cores=False):
        raise runner.StudyError(f"{plan.label}: leftover")

    monkeypatch.setattr(cli.runner, "launch", failing)
    with pytest.raises(runner.StudyError, match="leftover"):
        cli.train(spec, plans, retry_failed=False, parallel=2)


def test_shared_cores_env_sets_one_thread_unless_the_caller_did(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert runner.shared_cores_env({"A": "1"}) == {"A": "1", "OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert runner.shared_cores_env({"A": "1"}) == {"A": "1"}
