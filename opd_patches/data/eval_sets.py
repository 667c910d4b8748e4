"""Fill the evaluation data folder: any table of problems -> `<out>/<name>.jsonl` rows {id, problem, answer}.

    python -m opd_patches.data.eval_sets [--out DIR] NAME=SOURCE [NAME=SOURCE ...]
    make data-eval EVAL_SETS="math500=HuggingFaceH4/MATH-500:test aime24=HuggingFaceH4/aime_2024:train aime25=math-ai/aime25:test"

SOURCE is a local .parquet / .jsonl / .json file, or (online) a Hugging Face dataset `owner/name[:split]`
or `owner/name:config:split`, loaded with `datasets.load_dataset` (without a split, the dataset's only
split); `A+B` concatenates several sources into one set (opencompass/AIME2025 ships AIME I and II as
two configs: `opencompass/AIME2025:AIME2025-I:test+opencompass/AIME2025:AIME2025-II:test`).

Columns are mapped: the problem from `problem` / `question` / `Problem` / `Question`, the answer from
`answer` / `Answer` / `ground_truth` (numbers become strings), the id from `id` / `unique_id` / `ID`,
else `<NAME>-<row:04d>`. A numeric id (HuggingFaceH4/aime_2024's and math-ai/aime25's are numbers)
counts within its own source only, so it becomes `<NAME>-<id>`: the sets a suite reads together (aime24
and aime25) then cannot share an id. Rows without a problem or an answer are an error naming the row.

`--out` defaults to the evaluation data folder (`$OPD_EVAL_DATA`, else ~/data/opd-eval), where
`opd_patches.eval` suites look for `math500.jsonl`, `aime24.jsonl` and `aime25.jsonl` and where
`make data` finds the sets to decontaminate against.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

PROBLEM_KEYS = ("problem", "question", "Problem", "Question")
ANSWER_KEYS = ("answer", "Answer", "ground_truth")
ID_KEYS = ("id", "unique_id", "ID")
# The sets this project evaluates, by public dataset id (what the README and the errors of `make data` name).
EXAMPLE = "math500=HuggingFaceH4/MATH-500:test aime24=HuggingFaceH4/aime_2024:train aime25=math-ai/aime25:test"
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _hub_rows(source: str) -> list[dict]:
    name, *rest = source.split(":")
    if not _HUB_ID.match(name) or len(rest) > 2 or not all(rest):
        raise FileNotFoundError(f"{source} is neither an existing file nor a Hugging Face dataset id "
                                "(owner/name, owner/name:split or owner/name:config:split)")
    config, split = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0] if rest else None)
    try:
        from datasets import load_dataset
    except ImportError:
        raise ValueError(f"{source}: loading a Hugging Face dataset needs the `datasets` package; or download "
                         "the file and give its path") from None
    try:
        data = load_dataset(name, config, split=split)
    except Exception as exc:  # offline, unknown dataset/config/split: one line, and the way around it
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{source}: could not load {name} (config {config}, split {split}): {first}. "
                         "Without network, download the file elsewhere and give its path") from None
    if split is None:
        if len(data) != 1:
            raise ValueError(f"{source} has splits {', '.join(data)}: name one, e.g. {name}:{next(iter(data))}")
        data = next(iter(data.values()))
    return list(data)


def _rows(source: str) -> list[dict]:
    path = Path(source).expanduser()
    if path.is_file():
        from opd_patches.data.files import read_rows

        return read_rows(path)
    if "+" in source:
        return [row for part in source.split("+") for row in _rows(part)]
    if path.suffix in (".parquet", ".jsonl", ".json"):
        raise FileNotFoundError(f"{source} does not exist")
    return _hub_rows(source)


def _first(row: dict, keys) -> object:
    for k in keys:
        value = row.get(k)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if str(value).strip():
            return value
    return None


def _id(name: str, value, i: int) -> str:
    if value is None:
        return f"{name}-{i:04d}"
    text = str(value).strip()
    return f"{name}-{text}" if text.isdigit() else text


def convert(name: str, source: str, out: Path) -> Path:
    rows = []
    for i, row in enumerate(_rows(source)):
        problem, answer = _first(row, PROBLEM_KEYS), _first(row, ANSWER_KEYS)
        if problem is None or answer is None:
            raise KeyError(f"{source} row {i} has no problem ({'/'.join(PROBLEM_KEYS)}) or answer "
                           f"({'/'.join(ANSWER_KEYS)}); its columns: {', '.join(map(str, row))}")
        rows.append({"id": _id(name, _first(row, ID_KEYS), i), "problem": str(problem).strip(),
                     "answer": str(answer).strip()})
    if not rows:
        raise ValueError(f"{source}: no rows")
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
                raise ValueError(f"{spec!r}: expected NAME=SOURCE, e.g. {EXAMPLE.split()[0]}")
            convert(name, source, out)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"[data-eval] error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
