"""`make select` (opd_patches/study/select.py): the ranking rule on hand-built per-question results, the
known-answer task's proxy and final halves, the refusals of bad input, and (slow) a whole selection on a
run folder with two planted checkpoints whose order is known: the task's student as step 1 and its teacher
as step 2, real receipts, real evaluations on the CPU.
"""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opd_patches.eval import suites
from opd_patches.ops import receipts
from opd_patches.study import select

REPO = Path(__file__).resolve().parents[1]
TASK = REPO / ".cache" / "addition"
OK = {"ok": True, "checks": {}, "error": None}
SPLIT = ["--proxy", "addition_proxy", "--final", "addition_final"]


def results(outcomes: list[int], samples: int = 2) -> dict:
    """{question: [outcome] * samples} for one outcome per question."""
    return {f"q{i}": [o] * samples for i, o in enumerate(outcomes)}


def test_a_step_within_one_se_of_the_best_wins_when_it_is_later():
    # step 10 is best (0.6); step 20 is behind it on 2 questions and ahead on 1: diff -0.1, per-question
    # differences [-1, -1, +1, 0 x 7] have std sqrt(2.9 / 9), SE = that / sqrt(10) = 0.1795 > 0.1: within.
    # Step 30 (0.1) is not within, and later: the latest step *within* one SE is chosen, not the latest.
    best = [1, 1, 0, 1, 1, 1, 1, 0, 0, 0]
    rows = select.rank({10: results(best), 20: results([0, 0, 1, 1, 1, 1, 1, 0, 0, 0]),
                        30: results([1, 0, 0, 0, 0, 0, 0, 0, 0, 0])})
    by = {r["step"]: r for r in rows}
    assert [r["step"] for r in rows] == [10, 20, 30]
    assert by[10]["best"] and by[10]["pass_at_1"] == pytest.approx(0.6) and by[10]["diff_vs_best"] == 0.0
    assert by[20]["diff_vs_best"] == pytest.approx(-0.1)
    assert by[20]["se_diff"] == pytest.approx(math.sqrt(2.9 / 9) / math.sqrt(10))
    assert by[20]["within_one_se"] and not by[30]["within_one_se"]
    assert [r["step"] for r in rows if r["chosen"]] == [20]


def test_a_clearly_better_earlier_step_still_wins():
    # step 5: 0.9 on 20 questions; step 15: 0.3, behind on 12 questions and ahead on none: diff -0.6,
    # per-question differences [-1 x 12, 0 x 8]: SE = std / sqrt(20) = 0.1124, far below 0.6.
    early = results([1] * 18 + [0] * 2)
    late = results([1] * 6 + [0] * 12 + [0] * 2)
    rows = select.rank({5: early, 15: late})
    assert [r["step"] for r in rows if r["chosen"]] == [5] and rows[0]["best"]
    assert rows[1]["diff_vs_best"] == pytest.approx(-0.6)
    d = [-1.0] * 12 + [0.0] * 8
    mean = sum(d) / 20
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / 19) / math.sqrt(20)
    assert rows[1]["se_diff"] == pytest.approx(se) and not rows[1]["within_one_se"]
    assert rows[0]["se"] == pytest.approx(math.sqrt(0.9 * 0.1 * 20 / 19) / math.sqrt(20))


def test_equal_scores_make_the_later_step_best_and_chosen():
    same = results([1, 0, 1, 1])
    rows = select.rank({1: same, 2: dict(same), 3: results([0, 0, 0, 0])})
    assert [(r["step"], r["best"], r["chosen"]) for r in rows] == [(1, False, False), (2, True, True), (3, False, False)]


def test_the_task_split_into_a_proxy_and_a_final_half():
    whole = suites.load_questions(suites.load_protocol("addition"), Path("."))
    proxy = suites.load_questions(suites.load_protocol("addition_proxy"), Path("."))
    final = suites.load_questions(suites.load_protocol("addition_final"), Path("."))
    assert len(whole) == 200 and len(proxy) == len(final) == 100
    assert proxy + final == whole and not {q["id"] for q in proxy} & {q["id"] for q in final}
    assert suites.load_questions(suites.load_protocol("addition_final"), Path("."), limit=3) == whole[100:103]
    beyond = {**suites.load_protocol("addition_final"), "question_offset": 150}
    with pytest.raises(ValueError, match="questions 151..250 asked, generator 'addition' has 200"):
        suites.load_questions(beyond, Path("."))


def plant(run: Path, step: int, model: Path | None = None, validation: dict | None = OK) -> Path:
    """A state folder with an export (a copy of `model`, else one small file) and a real receipt."""
    state = run / f"global_step_{step}"
    export = state / receipts.HF_EXPORT
    if model is not None:
        shutil.copytree(model, export)
    else:
        export.mkdir(parents=True)
        (export / "config.json").write_text("{}")
    receipts.write(state, step, validation)
    return state


@pytest.fixture(scope="module")
def task():
    """The known-answer task's models, built (or found up to date) by the command tests/test_learn.py uses,
    in a child process: its progress lines stay out of this process's output."""
    done = subprocess.run([sys.executable, "-m", "opd_patches.embedded", "--task", "addition", "--out", str(TASK)],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {"student": TASK / "student", "teacher": TASK / "teacher"}


def _refusal(capsys, argv) -> str:
    code = select.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("[select] error: "), (code, out, err)
    return err


def test_bad_input_is_refused_in_one_line(tmp_path, capsys, task):
    assert "no such run folder: " in _refusal(capsys, [str(tmp_path / "nope"), *SPLIT])
    run = tmp_path / "run"
    run.mkdir()
    err = _refusal(capsys, [str(run), "--proxy", "nope", "--final", "addition_final"])
    assert "--proxy nope: unknown suite; known: " in err and "addition_proxy" in err and "math500" in err
    assert "--final aimee: unknown suite" in _refusal(capsys, [str(run), "--proxy", "addition_proxy", "--final", "aimee"])
    err = _refusal(capsys, [str(run), "--data-dir", str(tmp_path), "--student", str(task["student"])])
    assert "math500.jsonl is missing" in err  # the default proxy's data, checked before anything runs
    assert "no global_step_N folders" in _refusal(capsys, [str(run), *SPLIT])
    plant(run, 1, validation={"ok": False, "checks": {}, "error": "weights not finite"})
    plant(run, 2, validation=None)
    (run / "global_step_3").mkdir()
    err = _refusal(capsys, [str(run), *SPLIT, "--student", str(task["student"])])
    assert "no complete, validated export" in err
    assert "step 1: export validation failed (weights not finite); step 2: export not validated; " \
           "step 3: incomplete (no receipt)" in err
    plant(run, 4)
    err = _refusal(capsys, [str(run), *SPLIT])
    assert "no student: " in err and "records no actor_rollout_ref.model.path; give it with --student" in err
    (run / "manifest.json").write_text(json.dumps({"config": {"actor_rollout_ref": {"model": {"path": str(tmp_path / "gone")}}}}))
    err = _refusal(capsys, [str(run), *SPLIT])
    assert "the manifest's actor_rollout_ref.model.path" in err and str(tmp_path / "gone") in err
    assert "--samples 0: give a positive number" in _refusal(capsys, [str(run), *SPLIT, "--samples", "0"])


def test_the_student_comes_from_the_manifest_and_is_known_by_its_files(tmp_path, task):
    run = tmp_path / "run"
    plant(run, 1, validation={"ok": False, "checks": {}, "error": "weights not finite"})
    plant(run, 2)
    (run / "manifest.json").write_text(json.dumps({"config": {"actor_rollout_ref": {"model": {"path": str(task["student"])}}}}))
    plan = select.prepare(select.parser().parse_args([str(run), *SPLIT, "--cache", str(tmp_path / "cache")]))
    assert plan.student == task["student"].resolve() and [c["step"] for c in plan.eligible] == [2]
    assert plan.skipped == [{"step": 1, "reason": "export validation failed (weights not finite)"}]
    copy = shutil.copytree(task["student"], tmp_path / "elsewhere" / "student")
    assert select.model_digest(copy) == plan.digest != select.model_digest(task["teacher"])
    student = plan.job("addition_final")
    assert student.out == tmp_path / "cache" / plan.digest / "addition_final" and student.model_hash == plan.digest
    export = plan.job("addition_proxy", plan.eligible[0])
    assert export.out == run / "select" / "evals" / "global_step_2" / "addition_proxy"
    assert export.model == (run / "global_step_2" / receipts.HF_EXPORT).resolve()
    plant(run, 3, task["student"])  # the student's files as a checkpoint: its receipt gives the same digest
    assert select.candidates(run)[0][-1]["digest"] == plan.digest != export.model_hash


def _generations(root: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in sorted(root.rglob("generations.jsonl"))}


@pytest.mark.slow
def test_select_picks_the_teacher_scores_it_and_a_rerun_evaluates_only_what_is_new(tmp_path, task):
    run, cache = tmp_path / "run", tmp_path / "cache"
    plant(run, 1, task["student"])
    plant(run, 2, task["teacher"])
    cheap = ["--samples", "2", "--limit", "30", "--backend", "hf", "--cache", str(cache)]

    def select_(*extra, student=task["student"]):
        done = subprocess.run([sys.executable, "-m", "opd_patches.study.select", str(run), *SPLIT, *cheap,
                               "--student", str(student), *extra], cwd=REPO, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    out = select_()
    assert out.count(": evaluated: pass@1") == 5  # 2 exports on the proxy, the choice on the final, the student on both
    sel = json.loads((run / "select" / "selection.json").read_text())
    assert sel["chosen_step"] == sel["best_step"] == 2
    step1, step2 = sel["ranking"]
    assert step2["pass_at_1"] >= 0.7 and step1["pass_at_1"] <= 0.4 and not step1["within_one_se"]
    assert step1["diff_vs_best"] < -3 * step1["se_diff"]
    assert sel["final"]["chosen"]["step"] == 2 and sel["final"]["chosen"]["n_questions"] == 30
    assert sel["final"]["chosen_vs_student"]["diff"] > 3 * sel["final"]["chosen_vs_student"]["se"] > 0
    assert sel["final"]["student"]["pass_at_1"] <= 0.4 and sel["student"]["proxy"]["pass_at_1"] <= 0.4
    for suite in ("addition_proxy", "addition_final"):
        assert (cache / sel["student"]["digest"] / suite / "summary.json").is_file()
    evals = run / "select" / "evals"
    assert {p.relative_to(evals).as_posix() for p in evals.glob("*/*/summary.json")} == {
        "global_step_1/addition_proxy/summary.json", "global_step_2/addition_proxy/summary.json",
        "global_step_2/addition_final/summary.json"}
    md = (run / "select" / "selection.md").read_text()
    assert "| 2 | " in md and "**chosen**" in md and "## Final: addition_final" in md and "| student |" in md
    assert "| 2 | " in out and "**chosen**" in out  # the table is printed too

    # The same command, with the student copied elsewhere: every evaluation reused, the cache by content.
    before = _generations(tmp_path)
    again = select_(student=shutil.copytree(task["student"], tmp_path / "moved" / "student"))
    assert "evaluating" not in again and again.count(": reused: pass@1") == 5
    assert _generations(tmp_path) == before
    assert json.loads((run / "select" / "selection.json").read_text())["ranking"] == sel["ranking"]

    # More training: a step 3 that scores as step 2 (a copy: the same samples) is within one SE and later.
    plant(run, 3, task["teacher"])
    more = select_()
    assert more.count("evaluating") == 2 and "proxy 3/3 step 3 (addition_proxy): evaluating" in more
    assert "final step 3 (addition_final): evaluating" in more
    sel3 = json.loads((run / "select" / "selection.json").read_text())
    assert sel3["chosen_step"] == 3 and sel3["ranking"][2]["diff_vs_best"] == 0.0 and sel3["ranking"][1]["within_one_se"]
    assert sel3["final"]["chosen"]["pass_at_1"] == sel["final"]["chosen"]["pass_at_1"]


def test_plot_reads_the_selections_evaluations_and_make_evals(tmp_path):
    from opd_patches.eval import plot

    run = tmp_path / "run"
    base = {"suite": "math500_pass_at_1", "model": "m", "n_questions": 3, "n_samples": 6, "per_source": {}, "se_clustered": 0.05}
    for folder, step, p in [(run / "select" / "evals" / "global_step_10" / "math500", 10, 0.2),
                            (run / "select" / "evals" / "global_step_20" / "math500", 20, 0.3),
                            (run / "global_step_20" / "eval" / "math500_pass_at_1", 20, 0.9),  # make eval's, same step
                            (run / "global_step_30" / "eval" / "math500_pass_at_1", 30, 0.35)]:
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({**base, "step": step, "pass_at_1": p}))
    kept = plot.one_per_step(plot.find_summaries([run]))
    assert sorted((s["step"], s["pass_at_1"]) for s in kept) == [(10, 0.2), (20, 0.3), (30, 0.35)]
    assert plot.main([str(run), "--out", str(tmp_path / "scores.png")]) == 0
    assert (tmp_path / "scores.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_model_known_by_its_digest_resumes_wherever_its_folder_lies(tmp_path):
    """The harness's settings check: with --model-hash, samples of the same digest from another path are the
    same model's (the student's cache); another digest, or none, is another model."""
    from opd_patches.eval.harness import _check_config

    out = tmp_path / "eval"
    out.mkdir()
    config = {"suite": "addition_final", "model": "/a/student", "model_hash": "d1", "max_new_tokens": 48,
              "temperature": 1.0, "top_p": 1.0, "seed": 0}
    (out / "eval_config.json").write_text(json.dumps(config))
    (out / "generations.jsonl").write_text(json.dumps({"id": "q", "sample": 0, "correct": True}) + "\n")
    _check_config(out, {**config, "model": "/b/student"})
    for other in ({"model_hash": "d2"}, {"model_hash": None}):
        (out / "eval_config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match="model: '/a/student' -> '/b/student'"):
            _check_config(out, {**config, "model": "/b/student", **other})


def test_an_evaluation_is_reused_only_with_the_settings_asked_for(tmp_path):
    """An option left unset means the protocol's: a cheaper earlier evaluation (2 samples, 50 questions) is
    not reused for the protocol's 4 samples on every question."""
    from opd_patches.study import evaluate

    model = tmp_path / "m"
    job = evaluate.EvalJob(None, "step 1", 1, "addition_proxy", tmp_path / "eval", model)
    job.out.mkdir()
    protocol = {"samples": 2, "max_new_tokens": 48, "temperature": 1.0, "top_p": 1.0, "seed": 0, "limit": 50}
    (job.out / "summary.json").write_text(json.dumps({"complete": True, "model": str(model), "protocol": protocol}))
    spec = {"limit": None, "samples": None, "max_new_tokens": None, "temperature": None, "top_p": None, "seed": None}
    assert evaluate.is_done(job, {**spec, "samples": 2, "limit": 50})
    assert not evaluate.is_done(job, spec) and not evaluate.is_done(job, {**spec, "samples": 2})
    assert not evaluate.is_done(evaluate.EvalJob(None, "step 1", 1, "addition_proxy", job.out, tmp_path / "other"),
                                {**spec, "samples": 2, "limit": 50})
    assert evaluate.settings_folder("addition_proxy", {**spec, "samples": 2, "max_new_tokens": 48}) == "addition_proxy"
    assert evaluate.settings_folder("aime", {**spec, "max_new_tokens": 8192}) == "aime-max_new_tokens=8192"


def test_a_failed_evaluation_names_its_log_and_chooses_nothing(tmp_path, capsys, task):
    """A validated export the harness cannot load (here: no weights): exit 1, no selection written."""
    run = tmp_path / "run"
    plant(run, 1)
    code = select.main([str(run), *SPLIT, "--student", str(task["student"]), "--cache", str(tmp_path / "cache"),
                        "--backend", "hf", "--limit", "2", "--samples", "1"])
    out = capsys.readouterr().out
    log = run / "select" / "evals" / "global_step_1" / "addition_proxy" / "eval.log"
    assert code == 1 and f"proxy 1/1 step 1 (addition_proxy): FAILED: exit 2; log {log}" in out
    assert "lacks weights" in log.read_text() and "not chosen" in out
    assert not (run / "select" / "selection.json").exists()
