"""Decontamination: which training problems overlap an evaluation problem.

A training problem is CONTAMINATED, and removed, when for some evaluation problem either

1. `exact`: their normalised texts are equal up to whitespace (`text.key`), or
2. `ngram`: they share at least `THRESHOLD` (0.5) of the word 8-grams of the shorter of the two:
   |G(train) & G(eval)| / min(|G(train)|, |G(eval)|) >= 0.5, with G the set of word 8-grams
   (`text.ngrams(problem, NGRAM)`).

Why these numbers: 8 words is longer than the stock phrases of competition problems ("can be written
as m/n where m and n are relatively prime", 13 words, shares only a few 8-grams with any one problem),
so one shared phrase does not flag a problem, while a copied problem with a reworded sentence, an
added preamble or a changed instruction keeps most of its 8-grams. Containment relative to the SHORTER
problem catches an evaluation problem embedded in a longer training prompt and vice versa. A changed
number breaks the 8 grams around it, so a problem with one number changed out of ~40 words is still
flagged (a perturbed copy), one with most numbers changed is not. Problems with fewer than 8 words
have no 8-grams and are only checked by rule 1.

The threshold sits above the overlap of distinct MATH-500 problems with each other (no pair reaches it)
and flags no problem of other competition sets (OlympiadBench, Minerva-Math, AMC23) against MATH-500 +
AIME 2024/2025, while every evaluation problem flags itself; the figures are in docs/training.md.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from opd_patches.data.text import key, ngrams

NGRAM = 8
THRESHOLD = 0.5


def read_eval_problems(paths) -> list[dict]:
    """[{"id", "problem", "set"}] from JSONL files (or folders of *.jsonl) with a `problem` field."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"evaluation set {p} does not exist (a .jsonl file or a folder of them)")
    if not files:
        raise FileNotFoundError(f"no *.jsonl evaluation sets under {', '.join(map(str, paths))}")
    out = []
    for f in files:
        for i, line in enumerate(f.read_text().splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            if "problem" not in row:
                raise KeyError(f"{f}:{i + 1} has no 'problem' field (evaluation sets are {{id, problem, answer}} JSONL)")
            out.append({"id": str(row.get("id", f"{f.stem}-{i}")), "problem": row["problem"], "set": f.stem})
    return out


class EvalIndex:
    """The evaluation problems, indexed by normalised text and by word n-gram."""

    def __init__(self, problems: list[dict], n: int = NGRAM, threshold: float = THRESHOLD):
        self.problems, self.n, self.threshold = problems, n, threshold
        self.exact: dict[str, int] = {}
        self.sizes: list[int] = []
        self.by_gram: dict[tuple, list[int]] = defaultdict(list)
        for i, row in enumerate(problems):
            self.exact.setdefault(key(row["problem"]), i)
            grams = ngrams(row["problem"], n)
            self.sizes.append(len(grams))
            for g in grams:
                self.by_gram[g].append(i)

    def match(self, problem: str) -> dict | None:
        """None, or {"kind": "exact"|"ngram", "eval_id", "eval_set", "overlap"} of the strongest match."""
        i = self.exact.get(key(problem))
        if i is not None:
            return self._found("exact", i, 1.0)
        grams = ngrams(problem, self.n)
        if not grams:
            return None
        shared = Counter(i for g in grams for i in self.by_gram.get(g, ()))
        best = None
        for i, count in shared.items():
            overlap = count / min(len(grams), self.sizes[i])
            if overlap >= self.threshold and (best is None or overlap > best[1]):
                best = (i, overlap)
        return self._found("ngram", *best) if best else None

    def _found(self, kind: str, i: int, overlap: float) -> dict:
        row = self.problems[i]
        return {"kind": kind, "eval_id": row["id"], "eval_set": row["set"], "overlap": round(overlap, 4)}
