"""Training-data preparation on a constructed DAPO-Math-17k-like file: duplicates removed, real
MATH-500 / AIME problems (verbatim, re-spaced, with a preamble, one number changed) removed, VERL's
own dataset class reads the output, and the prompt is the one evaluation renders.

The evaluation problems are the real ones (tests/real_problems.py: read in place, never copied).
"""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from opd_patches.task import prompt
from opd_patches.data import text
from opd_patches.data.decontaminate import NGRAM, THRESHOLD, EvalIndex
from opd_patches.data.prepare import prepare
from real_problems import DATA, missing

REPO = Path(__file__).resolve().parents[1]

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def eval_rows(name):
    path = DATA / f"{name}.jsonl"
    if not path.exists():
        pytest.skip(missing(path))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def dapo_row(problem, answer, i):
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_PREFIX + problem + DAPO_SUFFIX}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(answer), "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"uuid-{i}"},
    }


def fresh_problem(i):
    """A training problem no evaluation set holds (distinct numbers and wording per i)."""
    return (f"A gardener plants {i + 11} rows of tulips with {2 * i + 7} tulips in each row, then gives away "
            f"{i + 3} tulips to every one of her {i + 2} neighbours. How many tulips does she keep for herself?"), \
        (i + 11) * (2 * i + 7) - (i + 3) * (i + 2)


@pytest.fixture(scope="module")
def constructed(tmp_path_factory):
    """Sources with known duplicates and contamination, and what must come out."""
    tmp = tmp_path_factory.mktemp("data_src")
    m500, a24, a25 = eval_rows("math500"), eval_rows("aime24"), eval_rows("aime25")
    rows, expect_removed = [], {}
    for i in range(12):
        p, a = fresh_problem(i)
        rows.append(dapo_row(p, a, len(rows)))
    # duplicates: verbatim, and with other spacing / case / $ delimiters (same normalised text)
    rows.append(dapo_row(fresh_problem(0)[0], fresh_problem(0)[1], len(rows)))
    rows.append(dapo_row("  " + fresh_problem(1)[0].upper().replace(" ", "   "), fresh_problem(1)[1], len(rows)))
    rows.append(dapo_row(fresh_problem(2)[0], 999, len(rows)))  # a duplicate with another answer
    # contamination
    verbatim = m500[3]  # "How many positive whole-number divisors does 196 have?" (short: exact match only)
    rows.append(dapo_row(verbatim["problem"], verbatim["answer"], len(rows)))
    expect_removed[verbatim["id"]] = "exact"
    respaced = m500[2]
    rows.append(dapo_row(respaced["problem"].replace(" ", "  ").replace("$", ""), respaced["answer"], len(rows)))
    expect_removed[respaced["id"]] = "exact"
    preamble = a24[0]
    rows.append(dapo_row("Here is a nice problem about walking. " + preamble["problem"], preamble["answer"], len(rows)))
    expect_removed[preamble["id"]] = "ngram"
    changed = a25[1]  # the heptagon problem with one length changed
    assert "$AD = 4$" in changed["problem"]
    rows.append(dapo_row(changed["problem"].replace("$AD = 4$", "$AD = 5$"), 600, len(rows)))
    expect_removed[changed["id"]] = "ngram"
    dapo = tmp / "dapo_like.parquet"
    pd.DataFrame(rows).to_parquet(dapo, index=False)

    plain = tmp / "plain.jsonl"
    plain_rows = [
        {"problem": "What is the sum of the first 40 positive odd integers, counted one by one by a patient child?", "answer": "1600"},
        {"problem": fresh_problem(3)[0], "answer": str(fresh_problem(3)[1])},  # duplicate of a DAPO row
        {"problem": "A problem without an answer field."},  # invalid
        {"question": m500[10]["problem"], "answer": m500[10]["answer"]},  # contaminated, `question` key
    ]
    expect_removed[m500[10]["id"]] = "exact"
    plain.write_text("".join(json.dumps(r) + "\n" for r in plain_rows))
    return {"sources": [dapo, plain], "expect_removed": expect_removed, "n_rows": len(rows) + len(plain_rows)}


@pytest.fixture(scope="module")
def prepared(constructed, tmp_path_factory):
    out = tmp_path_factory.mktemp("data_out")
    report = prepare(constructed["sources"], out, eval_sets=[DATA], val_size=2, seed=0)
    return out, report


def test_stage_counts(prepared, constructed):
    out, report = prepared
    counts = report["counts"]
    n = constructed["n_rows"]
    assert counts["read"] == n
    assert counts["valid"] == n - 1  # the row without an answer
    assert counts["deduplicated"] == counts["valid"] - 4  # 3 DAPO duplicates + 1 plain duplicate
    assert report["removed"]["answer_conflict_groups"] == 1
    assert counts["decontaminated"] == counts["deduplicated"] - len(constructed["expect_removed"])
    assert counts["train"] == counts["decontaminated"] - 2 and counts["val"] == 2
    assert json.loads((out / "data_report.json").read_text())["counts"] == counts


def test_eval_problems_removed_and_others_kept(prepared, constructed):
    out, report = prepared
    removed = {r["eval_id"]: r["kind"] for r in report["contaminated_rows"]}
    assert removed == constructed["expect_removed"]
    assert report["decontamination"]["n_problems"] >= 560  # MATH-500 + AIME 24/25 at least
    kept = pd.concat([pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "val.parquet")])
    questions = set(kept["extra_info"].map(lambda e: e["question"]))
    for i in range(12):
        assert fresh_problem(i)[0] in questions
    assert "What is the sum of the first 40 positive odd integers, counted one by one by a patient child?" in questions


def test_verl_schema_and_shared_prompt(prepared, embedded):
    out, _ = prepared
    df = pd.read_parquet(out / "train.parquet")
    assert list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    row = df.iloc[0]
    problem = row["extra_info"]["question"]
    assert list(row["prompt"]) == prompt.messages(problem)
    assert "Solve the following" not in problem and "Remember to put" not in problem
    assert row["reward_model"]["style"] == "rule" and row["reward_model"]["ground_truth"] == row["extra_info"]["answer"]
    assert row["data_source"] == "math_dapo" and row["ability"] == "math"

    # VERL's own dataset reads it, and renders the chat exactly as evaluation does
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tok = AutoTokenizer.from_pretrained(embedded["tokenizer"])
    ds = RLHFDataset(str(out / "train.parquet"), tok, OmegaConf.create({"max_prompt_length": 1024, "cache_dir": str(out / "cache")}))
    assert len(ds) == len(df)
    item = ds[0]
    assert item["raw_prompt"] == prompt.messages(problem)
    rendered = tok.apply_chat_template(item["raw_prompt"], tokenize=False, add_generation_prompt=True)
    assert rendered == prompt.render(tok, problem)


def test_ngram_rule_hand_case():
    base = "one two three four five six seven eight nine ten"  # 10 words -> 3 word 8-grams
    index = EvalIndex([{"id": "e", "problem": base, "set": "s"}])
    assert NGRAM == 8 and THRESHOLD == 0.5
    assert len(text.ngrams(base, NGRAM)) == 3
    assert index.match("ONE two  $three$ four five six seven eight nine ten")["kind"] == "exact"
    # 2 of 3 grams shared (>= 0.5): flagged
    assert index.match("one two three four five six seven eight nine eleven")["overlap"] == pytest.approx(2 / 3, abs=1e-4)  # rounded to 4 places
    # 1 of 3 shared: kept
    assert index.match("one two three four five six seven eight zero eleven") is None
    # shorter than 8 words: exact match only
    assert index.match("one two three") is None


@pytest.mark.slow
def test_make_data_cli(constructed, tmp_path):
    out = tmp_path / "prepared"
    srcs = " ".join(map(str, constructed["sources"]))
    proc = subprocess.run(
        ["make", "-s", "data", "PREPARED=1", f"PY={sys.executable}", f"SRC={srcs}", f"OUT={out}",
         f"DATA_ARGS=--eval-sets {DATA / 'math500.jsonl'} {DATA / 'aime24.jsonl'} {DATA / 'aime25.jsonl'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for stage in ("read", "valid", "deduplicated", "decontaminated", "train"):
        assert f"[data] {stage}" in proc.stdout
    assert (out / "train.parquet").exists() and (out / "data_report.json").exists()
    bad = subprocess.run([sys.executable, "-m", "opd_patches.data", str(tmp_path / "missing.jsonl"), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "missing.jsonl does not exist" in bad.stderr


def test_make_data_eval_fills_the_evaluation_folder(tmp_path):
    """Local tables with other column names -> {id, problem, answer} JSONL that the aime suite loads."""
    from opd_patches.eval import suites

    a24 = eval_rows("aime24")
    pd.DataFrame([{"ID": r["id"], "Problem": r["problem"], "Answer": int(r["answer"])} for r in a24]).to_parquet(
        tmp_path / "a24.parquet", index=False)
    (tmp_path / "a25.jsonl").write_text("".join(json.dumps({"question": r["problem"], "answer": r["answer"]}) + "\n"
                                                for r in eval_rows("aime25")))
    out = tmp_path / "opd-eval"
    proc = subprocess.run(
        ["make", "-s", "data-eval", "PREPARED=1", f"PY={sys.executable}", f"OUT={out}",
         f"EVAL_SETS=aime24={tmp_path / 'a24.parquet'} aime25={tmp_path / 'a25.jsonl'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    qs = suites.load_questions(suites.load_protocol("aime"), out)
    assert len(qs) == 60
    assert qs[0] == {"id": a24[0]["id"], "problem": a24[0]["problem"], "answer": a24[0]["answer"], "source": "aime24"}
    assert qs[30]["id"] == "aime25-0000" and qs[30]["answer"] == eval_rows("aime25")[0]["answer"]
    from opd_patches.data.eval_sets import main

    assert main(["--out", str(out), f"x={tmp_path / 'nope.parquet'}"]) == 2
