"""Paired comparison of two evaluations on the same questions.

    python -m opd_patches.eval.compare A B [--names a b] [--out diff.json]

A and B are evaluation folders (holding generations.jsonl) or generations.jsonl files. The questions
both cover are paired; per question the difference of mean outcomes is taken, its clustered SE and a
two-sided p-value (Student's t) come from `opd_patches.eval.stats.paired_difference`, whose verdict is
printed ("within noise" unless |diff| >= 2 SE and p < 0.05). Several seeds of one model can be pooled
first by giving a comma-separated list of folders as A or B (`stats.aggregate_seeds`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from opd_patches.eval import stats
from opd_patches.eval.summary import load_records, results


def load_results(spec: str) -> dict:
    """Results mapping of one evaluation, or of several (comma-separated) pooled over seeds."""
    mappings = []
    for part in spec.split(","):
        path = Path(part)
        if path.is_dir():
            path = path / "generations.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist (give an evaluation folder or its generations.jsonl)")
        records, _ = load_records(path)
        if not records:
            raise ValueError(f"{path} holds no graded samples")
        mappings.append(results(records))
    if len(mappings) == 1:
        return mappings[0]
    return stats.aggregate_seeds(mappings)["pooled_results"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opd_patches.eval.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--names", nargs=2, default=["a", "b"])
    ap.add_argument("--out", type=Path, help="write the comparison (without per-question rows) as JSON")
    args = ap.parse_args(argv)
    try:
        res = stats.paired_difference(load_results(args.a), load_results(args.b), *args.names)
    except (FileNotFoundError, ValueError) as exc:
        print(f"[compare] error: {exc}", file=sys.stderr)
        return 2
    brief = {k: v for k, v in res.items() if k != "per_question"}
    print(json.dumps(brief, indent=2))
    print(res["verdict"])
    if args.out:
        args.out.write_text(json.dumps({**brief, "per_question": res["per_question"]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
