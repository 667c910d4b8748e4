"""The evaluation harness end to end on the tiny embedded model (CPU, hf backend): `make eval` on 3
MATH-500 questions x 2 samples x 16 tokens writes all three outputs; a cut-off run resumes with only
the missing samples; other settings in the same folder are refused; the verifier is consulted only on
samples the rule grader could not decide; plots and the paired comparison of two result files.

Questions come from tests/real_problems.py's folder (read in place; skipped where absent).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from background import Spec, shared_run
from opd_patches.task import prompt
from opd_patches.eval import compare, harness, plot, summary, suites
from opd_patches.eval.verifier import apply_verdict, build_prompt, parse_verdict
from real_problems import DATA, missing

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
SMALL = ["--limit", "3", "--samples", "2", "--max-new-tokens", "16"]


@pytest.fixture(scope="module")
def data_dir():
    if not (DATA / "math500.jsonl").exists():
        pytest.skip(missing(DATA / "math500.jsonl"))
    return DATA


def _make_eval_spec(base):
    """`make eval` on the tiny student (a shared run, tests/background.py; output in base/math500)."""
    from conftest import build_embedded

    return Spec(argv=["make", "-s", "eval", "PREPARED=1", f"PY={sys.executable}", f"MODEL={build_embedded()['student']}",
                      "SUITE=math500", f"OUT={base / 'math500'}",
                      f"EVAL_ARGS={' '.join(SMALL)} --data-dir {DATA} --backend hf"], timeout=600)


make_eval_run = shared_run("make_eval_run", _make_eval_spec, cost=0.5)


@pytest.fixture(scope="module")
def make_eval(data_dir, make_eval_run):
    """`make eval` on the tiny student: (process, out folder)."""
    return make_eval_run, make_eval_run.out / "math500"


@pytest.mark.slow
def test_make_eval_writes_all_outputs(make_eval):
    proc, out = make_eval
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[eval] estimate:" in proc.stdout and "tokens/s" in proc.stdout
    records, bad = summary.load_records(out / "generations.jsonl")
    assert bad == 0 and len(records) == 6
    assert {(r["id"], r["sample"]) for r in records} == {(f"math500-000{i}", k) for i in range(3) for k in range(2)}
    for r in records:
        assert r["grader"] == "rule" and r["decided_by"] and r["reason"]
        assert 1 <= r["n_tokens"] <= 16 and r["truncated"] == (r["finish_reason"] == "length")
    s = json.loads((out / "summary.json").read_text())
    for key in ("suite", "model", "pass_at_1", "se_clustered", "n_questions", "n_samples", "truncation_rate"):
        assert key in s, key
    assert (s["suite"], s["n_questions"], s["n_samples"], s["complete"]) == ("math500_pass_at_1", 3, 6, True)
    assert s["protocol"] == {"samples": 2, "max_new_tokens": 16, "temperature": 0.6, "top_p": 0.95, "seed": 42, "limit": 3}
    assert s["truncation_rate"] == pytest.approx(sum(r["truncated"] for r in records) / 6)
    assert (out / "scores.png").read_bytes()[:8] == PNG


@pytest.mark.slow
def test_resume_samples_only_what_is_missing(make_eval, embedded, data_dir, tmp_path):
    proc, first = make_eval
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "resumed"
    shutil.copytree(first, out)
    lines = (out / "generations.jsonl").read_text().splitlines(keepends=True)
    # 3 complete lines, then the start of a 4th, as a run killed mid-write leaves them
    (out / "generations.jsonl").write_text("".join(lines[:3]) + lines[3][:25])
    args = vars(__import__("opd_patches.eval.cli", fromlist=["parser"]).parser().parse_args(
        ["--model", str(embedded["student"]), "--suite", "math500", "--out", str(out), "--data-dir", str(data_dir),
         "--backend", "hf", *SMALL]))
    s = harness.run(args)
    assert s["generated_this_run"] == 3 and s["complete"] and s["n_samples"] == 6
    records, bad = summary.load_records(out / "generations.jsonl")
    assert bad == 0 and len(records) == 6
    assert [json.loads(x) for x in lines[:3]] == records[:3]  # the finished samples are kept as they were
    # a second resume has nothing left to do
    assert harness.run(args)["generated_this_run"] == 0


@pytest.mark.slow
def test_other_settings_in_the_same_folder_are_refused(make_eval, embedded, data_dir):
    proc, out = make_eval
    assert proc.returncode == 0, proc.stderr
    again = subprocess.run(
        [sys.executable, "-m", "opd_patches.eval", "--model", str(embedded["student"]), "--suite", "math500", "--out",
         str(out), "--data-dir", str(data_dir), "--limit", "3", "--samples", "2", "--max-new-tokens", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert again.returncode == 2 and "max_new_tokens: 16 -> 8" in again.stderr


def test_protocols():
    m = suites.load_protocol("math500")
    assert (m["name"], m["files"], m["samples"], m["max_new_tokens"], m["seed"], m["temperature"], m["top_p"]) == (
        "math500_pass_at_1", ["math500.jsonl"], 4, 12288, 42, 0.6, 0.95)
    a = suites.load_protocol("aime")
    assert (a["files"], a["samples"], a["max_new_tokens"]) == (["aime24.jsonl", "aime25.jsonl"], 32, 31744)
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        suites.load_protocol("nope")


def test_aime_suite_has_sixty_questions(data_dir):
    qs = suites.load_questions(suites.load_protocol("aime"), data_dir)
    assert len(qs) == 60 and {q["source"] for q in qs} == {"aime24", "aime25"}


def test_missing_data_dir_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="math500.jsonl is missing"):
        suites.load_questions(suites.load_protocol("math500"), tmp_path)


# --- verifier ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("reply, verdict", [
    ("A", "correct"), (" B\n", "incorrect"), ("C: INVALID", "invalid"), ("<think>hmm, A or B?</think>\nB", "incorrect"),
    ("Final Judgment: \\boxed{A} - CORRECT", "correct"), ("The answer is INCORRECT.", "incorrect"),
    ("correct", "correct"), ("banana", None), ("", None), ("Absolutely", None),
])
def test_parse_verdict(reply, verdict):
    assert parse_verdict(reply) == verdict


def test_prompt_placeholders():
    text = build_prompt("What is {1+1}?", "2", "\\frac{4}{2}")
    assert "What is {1+1}?" in text and "\\frac{4}{2}" in text and "{gold}" not in text
    compass_style = "Q: {question}\nGold: {gold_answer}\nCandidate: {llm_response}\n\\boxed{{}}"
    assert build_prompt("q", "g", "a", compass_style) == "Q: q\nGold: g\nCandidate: a\n\\boxed{{}}"


def _record(i, response, gold):
    from opd_patches.eval.harness import _rule_grade
    from opd_patches.eval.completion import Completion

    item = {"id": f"q{i}", "sample": 0, "source": "t", "gold": gold, "seed": 0, "backend": "hf"}
    return _rule_grade(item, Completion(response, 5, "stop"), 10.0)


def test_verifier_is_asked_only_when_the_rule_grader_cannot_decide(embedded):
    records = [
        _record(0, "so \\boxed{4}", "4"),              # string_match
        _record(1, "so \\boxed{0.5}", "\\frac12"),     # math_verify, correct
        _record(2, "so \\boxed{5}", "4"),              # math_verify, wrong
        _record(3, "I give up", "4"),                  # no_answer
        _record(4, "so \\boxed{\\text{}}", "4"),       # parse_error: math-verify cannot parse the answer
    ]
    assert [r["decided_by"] for r in records] == ["string_match", "math_verify", "math_verify", "no_answer", "parse_error"]
    questions = {r["id"]: {"problem": f"question {r['id']}"} for r in records}
    args = {"verifier": str(embedded["teacher"]), "verifier_max_new_tokens": 8, "batch_size": 4}
    judged = harness.run_verifier(records, questions, args, "hf", 4096)
    assert judged == 1
    assert ["verifier" in r for r in records] == [False, False, False, False, True]
    v = records[4]["verifier"]
    assert v["model"] == str(embedded["teacher"]) and v["verdict"] == parse_verdict(v["output"])
    if v["verdict"] is None:  # the tiny judge's reply is noise: the rule result stands, and says so
        assert records[4]["grader"] == "rule" and not records[4]["correct"] and "unreadable" in records[4]["reason"]
    else:
        assert records[4]["grader"] == "verifier" and records[4]["correct"] == (v["verdict"] == "correct")
    assert harness.run_verifier(records, questions, args, "hf", 4096) == 0  # judged once only


def test_apply_verdict():
    r = {"decided_by": "timeout", "reason": "math-verify took longer than 10 s", "correct": False, "grader": "rule"}
    apply_verdict(r, "correct", "A", "judge")
    assert (r["grader"], r["decided_by"], r["correct"]) == ("verifier", "verifier", True)
    assert r["rule"] == {"decided_by": "timeout", "reason": "math-verify took longer than 10 s"}
    r2 = {"decided_by": "parse_error", "reason": "x", "correct": False, "grader": "rule"}
    apply_verdict(r2, None, "zzz", "judge")
    assert (r2["grader"], r2["correct"], r2["verifier"]["output"]) == ("rule", False, "zzz")


# --- summaries, comparison, plots ---------------------------------------------------------------------


def _write_generations(path, outcomes):
    """generations.jsonl with {question: [outcome per sample]}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": q, "sample": k, "source": "s", "correct": bool(o), "truncated": False, "n_tokens": 3,
                         "grader": "rule", "decided_by": "math_verify"})
             for q, outs in outcomes.items() for k, o in enumerate(outs)]
    path.write_text("\n".join(lines) + "\n")


def test_compare_two_result_files(tmp_path, capsys):
    a = {"q1": [1, 1], "q2": [1, 0], "q3": [0, 0], "q4": [1, 1]}
    b = {"q1": [0, 0], "q2": [1, 0], "q3": [0, 0], "q4": [1, 0], "q5": [1, 1]}
    _write_generations(tmp_path / "a" / "generations.jsonl", a)
    _write_generations(tmp_path / "b" / "generations.jsonl", b)
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "d.json")]) == 0
    d = json.loads((tmp_path / "d.json").read_text())
    # per-question differences 1, 0, 0, 0.5 on the 4 shared questions: mean 0.375,
    # sample std sqrt(0.6875 / 3) = 0.478714, SE = 0.478714 / 2 = 0.239357
    assert d["n_common"] == 4 and d["only_in_b"] == 1
    assert d["diff"] == pytest.approx(0.375) and d["se"] == pytest.approx(0.2393568, abs=1e-6)
    assert d["per_question"] == {"q1": 1.0, "q2": 0.0, "q3": 0.0, "q4": 0.5}
    assert "within noise" in capsys.readouterr().out
    # two seeds of A pooled per question
    _write_generations(tmp_path / "a2" / "generations.jsonl", {"q1": [0, 0], "q2": [1, 1], "q3": [0, 0], "q4": [1, 1]})
    pooled = compare.load_results(f"{tmp_path / 'a'},{tmp_path / 'a2'}")
    assert pooled["q1"] == [1, 1, 0, 0]


def test_summary_per_source_and_graders():
    recs = [{"id": f"{s}-{q}", "sample": k, "source": s, "correct": c, "truncated": t, "n_tokens": 10,
             "grader": "rule", "decided_by": "math_verify"}
            for s, q, k, c, t in [("x", 0, 0, 1, 0), ("x", 0, 1, 1, 1), ("x", 1, 0, 0, 0), ("x", 1, 1, 0, 0),
                                  ("y", 0, 0, 1, 0), ("y", 0, 1, 0, 1)]]
    config = {"suite": "t", "model": "m", "samples": 2, "max_new_tokens": 4, "temperature": 0.6, "top_p": 0.95,
              "seed": 42, "limit": None}
    s = summary.summarize(recs, config, n_expected=6)
    # per-question means 1, 0, 0.5: pass@1 0.5, SE = std([1, 0, .5], ddof=1) / sqrt(3) = 0.5 / sqrt(3)
    assert s["pass_at_1"] == pytest.approx(0.5) and s["se_clustered"] == pytest.approx(0.5 / 3 ** 0.5)
    assert s["truncation_rate"] == pytest.approx(2 / 6)
    assert s["per_source"]["x"]["pass_at_1"] == pytest.approx(0.5) and s["per_source"]["y"]["n_questions"] == 1
    assert s["graders"] == {"rule:math_verify": 6} and s["complete"]


def test_plots(tmp_path):
    base = {"suite": "math500_pass_at_1", "model": "m", "n_questions": 3, "n_samples": 6, "per_source": {}}
    for step, p in [(10, 0.2), (20, 0.3), (30, 0.35)]:
        d = tmp_path / "run" / f"global_step_{step}" / "eval" / "math500_pass_at_1"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({**base, "step": step, "pass_at_1": p, "se_clustered": 0.05}))
    assert plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "scores.png")]) == 0
    assert (tmp_path / "scores.png").read_bytes()[:8] == PNG
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "data": {"actor/distillation/loss": 1 / i, "response_length/mean": 10 * i,
                                                                "val-core/math/acc/mean@4": 0.1 * i}}) + "\n"
                               for i in range(1, 6)) + '{"step": 6, "da')  # a cut-off last line is skipped
    assert plot.main(["--curves", str(metrics), "--out", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG
    assert plot.main(["--curves", str(metrics), "--keys", "no/such", "--out", str(tmp_path / "x.png")]) == 2


def test_default_out_for_a_checkpoint():
    model = "outputs/k1/global_step_20/actor/huggingface"
    assert harness.default_out(model, "aime24_25_at32") == Path("outputs/k1/global_step_20/eval/aime24_25_at32")
    assert summary.step_of(model) == 20


def test_prompt_is_the_training_template(embedded):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded["tokenizer"])
    text = prompt.render(tok, "What is 2+3?")
    assert text.endswith("<|im_start|>assistant\n")
    assert "What is 2+3?\n" + prompt.INSTRUCTION in text


def test_plot_of_a_checkpoint_names_run_and_step_and_fits_the_title(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    model = "/home/user/outputs/k1_lr1e-6_long_run_name_seed3/global_step_120/actor/huggingface"
    assert plot.model_label(model) == "k1_lr1e-6_long_run_name_seed3 step 120"
    assert plot.model_label("/models/DeepSeek-R1-Distill-Qwen-1.5B") == "DeepSeek-R1-Distill-Qwen-1.5B"
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to measure its title
    s = {"suite": "math500_pass_at_1", "model": model, "step": 120, "pass_at_1": 0.3, "se_clustered": 0.02,
         "n_questions": 500, "n_samples": 2000, "per_source": {}}
    plot.plot_summary(s, tmp_path / "scores.png")
    fig = figures[0]
    title = fig.axes[0].title
    assert "k1_lr1e-6_long_run_name_seed3 step 120" in " ".join(title.get_text().split())  # wrapped at spaces
    box, edge = title.get_window_extent(fig.canvas.get_renderer()), fig.bbox
    assert edge.x0 <= box.x0 and box.x1 <= edge.x1 and box.y1 <= edge.y1, (box, edge)
