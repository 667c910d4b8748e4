"""Fill the evaluation data folder: any table of problems -> `<out>/<name>.jsonl` rows {id, problem, answer}.

    python -m opd_patches.data.eval_sets [--out DIR] NAME=SOURCE [NAME=SOURCE ...]
    make data-eval EVAL_SETS="math500=HuggingFaceH4/MATH-500:test aime24=HuggingFaceH4/aime_2024:train aime25=/data/aime25.parquet"

SOURCE is a local .parquet / .jsonl / .json file, or (online) a Hugging Face dataset `owner/name[:split]`
(split `test` by default) loaded with `datasets.load_dataset`. Columns are mapped: the problem from
`problem` / `question` / `Problem` / `Question`, the answer from `answer` / `Answer` / `ground_truth`
(numbers become strings), the id from `id` / `unique_id` / `ID`, else `<NAME>-<row:04d>`. Rows without
a problem or an answer are an error naming the row. `--out` defaults to the evaluation data folder
(`$OPD_EVAL_DATA`, else ~/data/opd-eval), where `opd_patches.eval` suites look for `math500.jsonl`,
`aime24.jsonl` and `aime25.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

PROBLEM_KEYS = ("problem", "question", "Problem", "Question")
ANSWER_KEYS = ("answer", "Answer", "ground_truth")
ID_KEYS = ("id", "unique_id", "ID")


def _rows(source: str) -> list[dict]:
    path = Path(source).expanduser()
    if path.exists():
        from opd_patches.data.prepare import _read

        return _read(path)
    if path.suffix in (".parquet", ".jsonl", ".json") or (source.count("/") != 1 and ":" not in source):
        raise FileNotFoundError(f"{source} is neither a file nor a Hugging Face dataset id (owner/name[:split])")
    from datasets import load_dataset

    name, _, split = source.partition(":")
    return list(load_dataset(name, split=split or "test"))


def _first(row: dict, keys) -> object:
    for k in keys:
        if row.get(k) is not None and str(row[k]).strip():
            return row[k]
    return None


def convert(name: str, source: str, out: Path) -> Path:
    rows = []
    for i, row in enumerate(_rows(source)):
        problem, answer = _first(row, PROBLEM_KEYS), _first(row, ANSWER_KEYS)
        if problem is None or answer is None:
            raise KeyError(f"{source} row {i} has no problem ({'/'.join(PROBLEM_KEYS)}) or answer ({'/'.join(ANSWER_KEYS)})")
        qid = _first(row, ID_KEYS)
        rows.append({"id": str(qid) if qid is not None else f"{name}-{i:04d}", "problem": str(problem).strip(),
                     "answer": str(answer).strip()})
    if len({r["id"] for r in rows}) != len(rows):
        raise ValueError(f"{source}: ids are not unique")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.jsonl"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    print(f"[data-eval] {name}: {len(rows)} problems from {source} -> {path}")
    return path


def main(argv=None) -> int:
    from opd_patches.eval.suites import default_data_dir

    ap = argparse.ArgumentParser(prog="python -m opd_patches.data.eval_sets", description=__doc__.split("\n\n")[0])
    ap.add_argument("sets", nargs="+", metavar="NAME=SOURCE")
    ap.add_argument("--out", type=Path, default=None, help="default: $OPD_EVAL_DATA, else ~/data/opd-eval")
    args = ap.parse_args(argv)
    out = args.out or default_data_dir()
    try:
        for spec in args.sets:
            name, sep, source = spec.partition("=")
            if not sep or not name or not source:
                raise ValueError(f"{spec!r}: expected NAME=SOURCE, e.g. math500=HuggingFaceH4/MATH-500:test")
            convert(name, source, out)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"[data-eval] error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
