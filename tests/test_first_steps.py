"""The README's first data steps as a user on a fresh machine takes them: an empty home folder, local
files standing in for the downloads, each in its public dataset's own columns (HuggingFaceH4/MATH-500,
HuggingFaceH4/aime_2024, opencompass/AIME2025's two configs, BytedTsinghua-SIA/DAPO-Math-17k), then
`make data-eval EVAL_SETS=...` and `make data SRC=...` exactly as written. Without the evaluation sets
`make data` refuses and names the command to run first, whatever lies beside the checkout: product code
reads no folder outside the repository. Also the column mappings of the other public copies of the sets,
and how a Hugging Face SOURCE is split into dataset, config and split (no network: load_dataset faked).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opd_patches.data import eval_sets
from opd_patches.data.eval_sets import EXAMPLE

REPO = Path(__file__).resolve().parents[1]
BESIDE = REPO.parent / "shared"

# Two real MATH-500 problems (test split) and one more in its columns.
MATH500 = [
    {"problem": "How many positive whole-number divisors does 196 have?",
     "solution": "First prime factorize $196=2^2\\cdot7^2$. ... $\\boxed{9}$.", "answer": "9",
     "subject": "Number Theory", "level": 3, "unique_id": "test/number_theory/572.json"},
    {"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.  Enter your answer in "
                "the form $(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$",
     "solution": "We have that $r = \\sqrt{0^2 + 3^2} = 3.$ ... $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
     "unique_id": "test/precalculus/807.json"},
    {"problem": "What is the remainder when $2^{100}$ is divided by $7$? Give the remainder as a whole number.",
     "solution": "Since $2^3 \\equiv 1$, ... $\\boxed{2}$.", "answer": "2", "subject": "Number Theory", "level": 2,
     "unique_id": "test/number_theory/999.json"},
]
# HuggingFaceH4/aime_2024 (train split): id int64, answer a string.
AIME24 = [
    {"id": 60, "problem": "Every morning Aya goes for a $9$-kilometer-long walk and stops at a coffee shop afterwards. "
                          "Find the number of minutes the walk takes her.", "solution": "...", "answer": "204",
     "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_1", "year": "2024"},
    {"id": 61, "problem": "Find the number of rectangles that can be formed inside a fixed regular dodecagon.",
     "solution": "...", "answer": "315",
     "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_II_Problems/Problem_15", "year": "2024"},
]
# opencompass/AIME2025, configs AIME2025-I and AIME2025-II: question, answer, no id.
AIME25_I = [{"question": "Find the sum of all integer bases $b>9$ for which $17_b$ is a divisor of $97_b.$",
             "answer": "70"}]
AIME25_II = [{"question": "Six points $A, B, C, D, E,$ and $F$ lie in a straight line in that order. Find the area of "
                          "$\\triangle BGE.$", "answer": "468"}]

DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
DAPO_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("index", pa.string())])),
])


def dapo_row(problem: str, answer: str, uid: str) -> dict:
    """One row of BytedTsinghua-SIA/DAPO-Math-17k's data/dapo-math-17k.parquet."""
    return {"data_source": "math_dapo", "prompt": [{"content": DAPO_PREFIX + problem + DAPO_SUFFIX, "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": uid}}


def fresh(i: int) -> tuple[str, str]:
    return (f"A baker fills {i + 4} trays with {3 * i + 5} rolls each and sells {i + 2} rolls to each of "
            f"{i + 3} customers. How many rolls are left over at the end of the day?",
            str((i + 4) * (3 * i + 5) - (i + 2) * (i + 3)))


@pytest.fixture()
def downloads(tmp_path):
    """The files a user downloads, in the public datasets' columns; HOME an empty folder."""
    src = tmp_path / "downloads"
    src.mkdir()
    pd.DataFrame(MATH500).to_parquet(src / "math500-test.parquet", index=False)
    (src / "aime_2024.jsonl").write_text("".join(json.dumps(r) + "\n" for r in AIME24))
    (src / "aime2025-I.jsonl").write_text("".join(json.dumps(r) + "\n" for r in AIME25_I))
    (src / "aime2025-II.jsonl").write_text("".join(json.dumps(r) + "\n" for r in AIME25_II))
    rows = []
    for repeat in range(3):  # the raw file repeats every problem
        for i in range(5):
            rows.append(dapo_row(*fresh(i), f"uid-{i}-{repeat}"))
    rows.append(dapo_row(MATH500[1]["problem"], MATH500[1]["answer"], "uid-contaminated"))
    pq.write_table(pa.Table.from_pylist(rows, schema=DAPO_SCHEMA), src / "dapo-math-17k.parquet")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OPD_EVAL_DATA"}
    return {"src": src, "home": home, "env": {**env, "HOME": str(home)}}


def make(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", *args, "PREPARED=1", f"PY={sys.executable}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_readme_first_steps(downloads):
    src, home, env = downloads["src"], downloads["home"], downloads["env"]
    aime25 = f"{src / 'aime2025-I.jsonl'}+{src / 'aime2025-II.jsonl'}"
    fetched = make(env, "data-eval", f"EVAL_SETS=math500={src / 'math500-test.parquet'} "
                                     f"aime24={src / 'aime_2024.jsonl'} aime25={aime25}")
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    folder = home / "data" / "opd-eval"  # the default evaluation data folder
    sets = {p.stem: [json.loads(line) for line in p.read_text().splitlines()] for p in folder.glob("*.jsonl")}
    assert sorted(sets) == ["aime24", "aime25", "math500"]
    assert sets["math500"][1] == {"id": "test/precalculus/807.json", "problem": MATH500[1]["problem"],
                                  "answer": MATH500[1]["answer"]}
    assert [r["id"] for r in sets["aime24"]] == ["aime24-60", "aime24-61"]  # numeric ids qualified
    assert sets["aime25"] == [{"id": "aime25-0000", "problem": AIME25_I[0]["question"], "answer": "70"},
                              {"id": "aime25-0001", "problem": AIME25_II[0]["question"], "answer": "468"}]

    prepared = make(env, "data", f"SRC={src / 'dapo-math-17k.parquet'}")
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    out = home / "data" / "dapo-math"  # run.sh's TRAIN_FILES default
    report = json.loads((out / "data_report.json").read_text())
    assert report["counts"] == {"read": 16, "valid": 16, "deduplicated": 6, "decontaminated": 5, "train": 5}
    assert [(r["eval_set"], r["eval_id"], r["kind"]) for r in report["contaminated_rows"]] == [
        ("math500", "test/precalculus/807.json", "exact")]
    assert report["decontamination"]["paths"] == [str(folder)]
    train = pd.read_parquet(out / "train.parquet")
    assert sorted(train["extra_info"].map(lambda e: e["question"])) == sorted(fresh(i)[0] for i in range(5))
    assert set(train["extra_info"].map(lambda e: e["source_index"])) == {f"uid-{i}-0" for i in range(5)}


def test_make_data_refuses_without_evaluation_sets(downloads, tmp_path):
    """Empty home folder, or an empty $OPD_EVAL_DATA: refused with the command to run first, though a folder
    of real evaluation sets may lie beside the checkout (as on the project's machines)."""
    src, env = downloads["src"], downloads["env"]
    empty = tmp_path / "opd-eval"
    empty.mkdir()
    cases = ((env, downloads["home"] / "data" / "opd-eval"), ({**env, "OPD_EVAL_DATA": str(empty)}, empty))
    for case_env, folder in cases:
        proc = make(case_env, "data", f"SRC={src / 'dapo-math-17k.parquet'}")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"make data-eval EVAL_SETS=\"{EXAMPLE}\"" in proc.stderr
        assert "make data-eval EVAL_SETS=\"math500=FILE aime24=FILE aime25=FILE\"" in proc.stderr
        assert "--no-decontaminate" in proc.stderr and str(folder) in proc.stderr
        assert str(BESIDE) not in proc.stdout + proc.stderr
        assert "[data] read" not in proc.stdout  # refused before the source is read
        assert not (downloads["home"] / "data" / "dapo-math").exists()
    escaped = make(env, "data", f"SRC={src / 'dapo-math-17k.parquet'}", "DATA_ARGS=--no-decontaminate")
    assert escaped.returncode == 0, escaped.stdout + escaped.stderr
    assert "skipped (--no-decontaminate)" in escaped.stdout


@pytest.mark.parametrize("rows, expected", [
    # math-ai/aime25 (test): problem, answer, id "0".."29"
    ([{"problem": "P0", "answer": "70", "id": "0"}, {"problem": "P1", "answer": "588", "id": "1"}],
     [{"id": "s-0", "problem": "P0", "answer": "70"}, {"id": "s-1", "problem": "P1", "answer": "588"}]),
    # MathArena/aime_2025 (train): problem_idx, problem, answer int64, problem_type
    ([{"problem_idx": 1, "problem": "P0", "answer": 70, "problem_type": ["Number Theory"]}],
     [{"id": "s-0000", "problem": "P0", "answer": "70"}]),
    # yentinglin/aime_2025 (train): id, problem, answer, solution, url, year
    ([{"id": "I-1", "problem": "P0", "answer": "70", "solution": "...", "url": "u", "year": "2025"}],
     [{"id": "I-1", "problem": "P0", "answer": "70"}]),
])
def test_public_aime_2025_copies(tmp_path, rows, expected):
    pd.DataFrame(rows).to_parquet(tmp_path / "in.parquet", index=False)
    eval_sets.convert("s", str(tmp_path / "in.parquet"), tmp_path)
    assert [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()] == expected


def test_hub_sources_name_dataset_config_and_split(monkeypatch, tmp_path):
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        rows = [{"question": f"{name} {config} {split}", "answer": 1}]
        return rows if split else {"train": rows}

    import datasets

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    eval_sets.convert("a", "opencompass/AIME2025:AIME2025-I:test+opencompass/AIME2025:AIME2025-II:test", tmp_path)
    eval_sets.convert("b", "HuggingFaceH4/aime_2024", tmp_path)  # no split: its only one
    assert calls == [("opencompass/AIME2025", "AIME2025-I", "test"), ("opencompass/AIME2025", "AIME2025-II", "test"),
                     ("HuggingFaceH4/aime_2024", None, None)]
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 2
    for bad in ("no_slash", "a/b:c:d:e", str(tmp_path / "absent.parquet")):
        with pytest.raises(FileNotFoundError):
            eval_sets.convert("x", bad, tmp_path)

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceH4/MATH-500' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert eval_sets.main(["--out", str(tmp_path), "math500=HuggingFaceH4/MATH-500:test"]) == 2
