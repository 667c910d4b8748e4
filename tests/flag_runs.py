"""Shared end-to-end runs (tests/conftest.py) that the tests of a patched path compare, each a real CPU run
of the VERL trainer on the tiny models:

- the bench's step phase (k1 and topk_tail at once, two steps each, the student's old-log-prob pass on);
- `upstream_paths`: topk_tail with the three switches of the training maths at upstream's own computation
  (UPSTREAM_PATHS: its sampled-token log-probs, its top-k loss, its old-log-prob pass), stopped by the
  wall clock.

The upstream run's step 1 and the bench's topk_tail step 1 see the same rollout and teacher, so the
fast paths must give the same metrics (test_lean_topk.py for the top-k loss, test_sampled_logprob.py for
the log-probs); the pass alone is compared tightly, bench against the smoke run (test_skip_old_log_prob.py)."""

import json
import sys
from pathlib import Path

from background import Spec

REPO = Path(__file__).resolve().parents[1]
# The wall-clock stop (test_ops_e2e.py) shares a flag-off run whose comparison reads step 1 only: 500
# steps requested, WALL_CLOCK=WALL_S RESERVE=0 counted from the first step (test-only key; the launch
# anchor is tests/test_ops_budget_guard.py's; counted from the launch, a loaded machine once spent 270 s
# before step 1). A smoke step takes 10-30 s here and the first save is predicted as long as a step, so
# the run stops after one to a few steps, once 1.5 x (step + save) no longer fits.
WALL_S = 45
# The switches of the training maths whose off value is upstream's own computation (recipes/base.yaml).
UPSTREAM_PATHS = ("opd.fast_logprobs=false", "opd.lean_topk=false", "opd.skip_old_log_prob=false")
BENCH_RECIPES = ("k1", "topk_tail")
LOGGERS = "trainer.logger=[console,tensorboard,wandb]"  # without `file`: opd_patches.main adds it back  # the bench step run's two trainings, on GPUs "0" and "1"


def wall_clock_run(recipe: str, *overrides: str):
    """A shared run's spec: `./run.sh recipe=RECIPE +overlay=smoke OVERRIDES` on the embedded models
    into the run's own folder (log: run.log there), stopped by the wall clock above."""
    def spec(out: Path) -> Spec:
        argv = [str(REPO / "run.sh"), f"recipe={recipe}", "+overlay=smoke", *overrides,
                "trainer.total_training_steps=500", "trainer.save_freq=100", "opd.debug.wall_clock_from_first_step=true"]
        env = {"EMBEDDED": "1", "OUTPUT_DIR": str(out), "PYTHON": sys.executable, "WALL_CLOCK": str(WALL_S),
               "RESERVE": "0"}
        return Spec(argv=argv, env=env, timeout=900)
    return spec


def run_pair(off: Path, on: Path) -> dict:
    """{"false": (metrics rows, run.log text), "true": (...)} of the run folders `off` and `on`."""
    runs = {}
    for value, run_dir in (("false", off), ("true", on)):
        log = (run_dir / "run.log").read_text(errors="replace")
        assert (run_dir / "metrics.jsonl").exists(), log[-3000:]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[value] = (rows, log)
    return runs


def bench_step_spec(base: Path) -> Spec:
    """`make bench PHASE=step RECIPE="k1 topk_tail" GPUS="0 1"` at SIZE=cpu (test_bench.py): two real run.sh
    trainings at once, two steps each, after an earlier recipe's result was merged into the same file.
    They run with the student's old-log-prob pass on (opd.skip_old_log_prob=false): the k1 and topk_tail
    counterparts of the smoke run (pass skipped, test_skip_old_log_prob.py), and topk_tail with the fast
    paths on beside `upstream_paths` (test_lean_topk.py, test_sampled_logprob.py). At SIZE=cpu the bench
    runs the embedded models with the smoke overlay, as the smoke run does; its runs are
    <base>/work/<recipe>/run_<recipe>/."""
    from tools.bench import results

    def prepare(base):
        earlier = {"steps": [], "rollout": "hf", "steps_done": 0, "steps_requested": 1}
        results.merge(base / "bench.json", "step", {"size": "cpu", "recipes": {"topk": earlier}})

    return Spec(argv=[sys.executable, "-m", "tools.bench", "--phase", "step", "--size", "cpu",
                      "--out", str(base / "bench.json"), "--recipe", *BENCH_RECIPES, "--gpus", "0", "1", "--steps", "2",
                      "--override", "opd.skip_old_log_prob=false", "--rollout", "hf", "--workdir", str(base / "work"),
                      "--timeout", "600"],
                timeout=900, prepare=prepare)


def bench_run_dir(bench_step_run, recipe: str) -> Path:
    return bench_step_run.out / "work" / recipe / f"run_{recipe}"
