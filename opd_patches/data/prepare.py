"""Training data -> VERL parquet: read, convert, de-duplicate, decontaminate, write, report.

    python -m opd_patches.data SRC [SRC ...] [--out DIR] [--eval-sets PATH ...] [--val-size N]
    make data SRC=... [OUT=DIR]

Sources (.parquet, .jsonl or .json; several are concatenated) hold either
- DAPO-Math-17k-style rows: `prompt` (chat messages; the problem is the last user message, DAPO's
  "Solve the following math problem step by step..." wrapper and "Remember to put your answer..."
  reminder removed, as is this project's own instruction), `reward_model.ground_truth`, optional
  `data_source`, `extra_info`; or
- plain rows: `problem` (or `question`) and `answer` (or `ground_truth`).

Stages, each counted in the report: `read` (all rows), `valid` (rows with a problem and an answer),
`deduplicated` (first row of each normalised problem text, `opd_patches.data.text.key`; how many
duplicate groups disagreed on the answer is reported), `decontaminated` (rows that overlap no
evaluation problem, rule and threshold in `opd_patches.data.decontaminate`), then the split into
`train` and, with `--val-size N`, `val` (N random rows, seed `--seed`).

Output rows (VERL's RL parquet schema, as the embedded data): `data_source` (the row's own, else
`--data-source`), `prompt` = `opd_patches.task.prompt.messages(problem)` (the template evaluation uses),
`ability` "math", `reward_model` {"style": "rule", "ground_truth": answer}, `extra_info` {"split",
"index", "question", "answer", "source", "source_row", plus the source's own extra_info keys}.
Written: `<out>/train.parquet` [`<out>/val.parquet`] and `<out>/data_report.json` (stage counts, the
evaluation sets used, every removed row with its match); the counts are also printed.

The evaluation sets default to every *.jsonl in the evaluation data folder (`$OPD_EVAL_DATA`, else
~/data/opd-eval, as `opd_patches.eval`), which `make data-eval` fills; none there is an error naming
that command, unless `--eval-sets` or `--no-decontaminate` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

from opd_patches.task import prompt as prompt_template
from opd_patches.data.decontaminate import NGRAM, THRESHOLD, EvalIndex, read_eval_problems
from opd_patches.data.files import must_exist, read_rows
from opd_patches.data.text import key

DEFAULT_OUT = Path.home() / "data" / "dapo-math"  # run.sh's TRAIN_FILES default lives here

_DAPO_PREFIX_RE = re.compile(
    r"^\s*Solve the following math problem step by step\.\s*The last line of your response should be of the "
    r"form Answer: \$Answer \(without quotes\) where \$Answer is the answer to the problem\.\s*"
)
_DAPO_SUFFIX_RE = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")


def _plain(value):
    """numpy arrays / scalars from parquet -> Python lists / values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def problem_text(row: dict) -> str | None:
    """The bare problem statement of a source row, or None."""
    for key in ("problem", "question"):
        if isinstance(row.get(key), str) and row[key].strip():
            return row[key].strip()
    chat = _plain(row.get("prompt"))
    if isinstance(chat, str):
        text = chat
    elif isinstance(chat, list):
        users = [m.get("content") for m in chat if isinstance(m, dict) and m.get("role") == "user"]
        text = users[-1] if users and isinstance(users[-1], str) else None
    else:
        text = None
    if text is None:
        return None
    text = _DAPO_SUFFIX_RE.sub("", _DAPO_PREFIX_RE.sub("", text))
    if text.endswith(prompt_template.INSTRUCTION):
        text = text[: -len(prompt_template.INSTRUCTION)]
    return text.strip() or None


def answer_text(row: dict) -> str | None:
    reward_model = _plain(row.get("reward_model"))
    candidates = [row.get("answer"), row.get("ground_truth")]
    if isinstance(reward_model, dict):
        candidates.insert(0, reward_model.get("ground_truth"))
    for value in candidates:
        value = _plain(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def default_eval_sets() -> list[Path]:
    from opd_patches.data.eval_sets import EXAMPLE
    from opd_patches.eval.suites import default_data_dir

    folder = default_data_dir()
    if folder.is_dir() and any(folder.glob("*.jsonl")):
        return [folder]
    raise FileNotFoundError(
        f"no evaluation sets to decontaminate against: the evaluation data folder {folder} ($OPD_EVAL_DATA, "
        f"else ~/data/opd-eval) holds no *.jsonl files. Fill it first (online, from the Hugging Face hub):\n"
        f"    make data-eval EVAL_SETS=\"{EXAMPLE}\"\n"
        f"or from local files (.parquet/.jsonl/.json with problem and answer columns):\n"
        f"    make data-eval EVAL_SETS=\"math500=FILE aime24=FILE aime25=FILE\"\n"
        f"then run make data again. Other sets: DATA_ARGS=\"--eval-sets FILE_OR_DIR ...\"; no decontamination "
        f"(training data may then hold evaluation problems): DATA_ARGS=--no-decontaminate"
    )


def prepare(sources, out: Path, eval_sets=None, decontaminate: bool = True, val_size: int = 0,
            seed: int = 0, data_source: str = "math") -> dict:
    """Run the pipeline; returns the report (also written to `<out>/data_report.json`)."""
    import pandas as pd

    started = time.time()
    stages, removed = [], {"invalid": 0, "duplicate": 0, "contaminated": []}
    for src in sources:  # every missing input refused before the sources are read
        must_exist(Path(src))
    if decontaminate:
        paths = [Path(p) for p in eval_sets] if eval_sets else default_eval_sets()
        problems = read_eval_problems(paths)

    def stage(name, n, note=""):
        stages.append({"stage": name, "rows": n, "note": note})
        print(f"[data] {name:<15} {n:>9,d} rows{'  ' + note if note else ''}", flush=True)

    rows = []
    for src in map(Path, sources):
        for i, row in enumerate(read_rows(src)):
            rows.append((src, i, row))
    stage("read", len(rows), f"from {', '.join(map(str, sources))}")

    valid = []
    for src, i, row in rows:
        problem, answer = problem_text(row), answer_text(row)
        if problem is None or answer is None:
            removed["invalid"] += 1
            continue
        valid.append({"src": src, "row": i, "raw": row, "problem": problem, "answer": answer})
    stage("valid", len(valid), "rows with a problem and an answer")

    first: dict[str, dict] = {}
    conflicts = set()
    for item in valid:
        k = key(item["problem"])
        kept = first.setdefault(k, item)
        if kept is not item:
            removed["duplicate"] += 1
            if key(kept["answer"]) != key(item["answer"]):
                conflicts.add(k)
    unique = list(first.values())
    stage("deduplicated", len(unique), f"{len(conflicts)} duplicate groups disagreed on the answer (first kept)")

    eval_info = None
    if decontaminate:
        index = EvalIndex(problems)
        kept = []
        for item in unique:
            found = index.match(item["problem"])
            if found is None:
                kept.append(item)
            else:
                removed["contaminated"].append(
                    {"source": str(item["src"]), "source_row": item["row"], "problem": item["problem"][:300], **found}
                )
        sets = sorted({p["set"] for p in problems})
        eval_info = {"paths": [str(p) for p in paths], "sets": sets, "n_problems": len(problems),
                     "rule": f"normalised exact match, or >= {THRESHOLD} of the shorter problem's word {NGRAM}-grams shared"}
        kinds = {k: sum(r["kind"] == k for r in removed["contaminated"]) for k in ("exact", "ngram")}
        stage("decontaminated", len(kept), f"{len(problems)} problems of {', '.join(sets)}; removed {kinds}")
        unique = kept
    else:
        stage("decontaminated", len(unique), "skipped (--no-decontaminate)")

    if val_size >= len(unique):
        raise ValueError(f"--val-size {val_size} leaves no training rows ({len(unique)} rows after decontamination)")
    order = list(range(len(unique)))
    random.Random(seed).shuffle(order)
    val_ids = set(order[:val_size])
    splits = {"train": [u for i, u in enumerate(unique) if i not in val_ids],
              "val": [u for i, u in enumerate(unique) if i in val_ids]}

    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, items in splits.items():
        if not items:
            continue
        records = [_verl_row(item, split, i, data_source) for i, item in enumerate(items)]
        files[split] = str(out / f"{split}.parquet")
        pd.DataFrame(records).to_parquet(out / f"{split}.parquet", index=False)
        stage(split, len(items), f"-> {files[split]}")

    report = {
        "sources": [str(s) for s in sources],
        "stages": stages,
        "counts": {s["stage"]: s["rows"] for s in stages},
        "removed": {"invalid": removed["invalid"], "duplicate": removed["duplicate"],
                    "answer_conflict_groups": len(conflicts), "contaminated": len(removed["contaminated"])},
        "decontamination": eval_info,
        "contaminated_rows": removed["contaminated"],
        "files": files,
        "prompt_template": prompt_template.user_content("{problem}"),
        "seed": seed,
        "elapsed_s": round(time.time() - started, 2),
    }
    tmp = out / "data_report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out / "data_report.json")
    print(f"[data] report -> {out / 'data_report.json'}", flush=True)
    return report


def _verl_row(item: dict, split: str, index: int, default_source: str) -> dict:
    raw = item["raw"]
    extra = _plain(raw.get("extra_info"))
    extra = {k: _plain(v) for k, v in extra.items()} if isinstance(extra, dict) else {}
    extra = {k: (v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v)) for k, v in extra.items()}
    source = raw.get("data_source")
    return {
        "data_source": source if isinstance(source, str) and source else default_source,
        "prompt": prompt_template.messages(item["problem"]),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": item["answer"]},
        "extra_info": {**{f"source_{k}": v for k, v in extra.items()}, "split": split, "index": index,
                       "question": item["problem"], "answer": item["answer"], "source": str(item["src"]),
                       "source_row": int(item["row"])},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opd_patches.data", description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", help=".parquet/.jsonl/.json files (DAPO-style or {problem, answer})")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--eval-sets", nargs="*", help="evaluation JSONL files or folders to decontaminate against")
    ap.add_argument("--no-decontaminate", action="store_true")
    ap.add_argument("--val-size", type=int, default=0, help="hold out N random rows as val.parquet")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-source", default="math", help="data_source for rows that have none")
    args = ap.parse_args(argv)
    try:
        prepare(args.sources, args.out, args.eval_sets, not args.no_decontaminate, args.val_size, args.seed,
                args.data_source)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"[data] error: {exc}", file=sys.stderr)
        return 2
    return 0
