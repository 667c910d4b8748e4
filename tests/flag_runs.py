"""The real 2-step CPU smoke run of a recipe (VERL trainer, tiny models) with a recipe switch off and on:
what the end-to-end tests of a patched path compare (test_lean_topk.py, test_sampled_logprob.py). The
switch's default (on) is the shared smoke run; the off run is a shared run of its own (tests/conftest.py)."""

import json
from pathlib import Path


def run_pair(off: Path, on: Path) -> dict:
    """{"false": (metrics rows, run.log text), "true": (...)} of the run folders `off` and `on`."""
    runs = {}
    for value, run_dir in (("false", off), ("true", on)):
        log = (run_dir / "run.log").read_text(errors="replace")
        assert (run_dir / "metrics.jsonl").exists(), log[-3000:]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[value] = (rows, log)
    return runs
