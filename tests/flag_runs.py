"""The real 2-step CPU smoke run of a recipe (VERL trainer, tiny models) with a recipe switch off and on:
what the end-to-end tests of a patched path compare (test_lean_topk.py, test_sampled_logprob.py)."""

import json
from pathlib import Path


def run_pair(out: Path, recipe: str, key: str, timeout: int = 400) -> dict:
    """{"false": (metrics rows, run.log text), "true": (...)} of `recipe` run with `key`=false and =true."""
    from opd_patches.smoke import run_recipe

    runs = {}
    for value in ("false", "true"):
        result = run_recipe(recipe, out / value, timeout, [f"{key}={value}"])
        assert result["ok"], result
        run_dir = Path(result["run_dir"])
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[value] = (rows, (run_dir / "run.log").read_text(errors="replace"))
    return runs
