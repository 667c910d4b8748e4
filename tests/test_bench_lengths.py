"""Length profiles of `make bench PHASE=step LENGTHS=...` (opd_patches/hooks/lengths.py): the documented fit,
deterministic draws, refusals, and a real bench run whose rollout generates exactly the lengths asked for."""

import json
import math
import sys
from pathlib import Path
from statistics import NormalDist

import length_stats
import pytest
from background import Spec, shared_run
from omegaconf import OmegaConf

from opd_patches.hooks import lengths

REPO = Path(__file__).resolve().parents[1]


def test_seed_profile_reproduces_the_clip_rate_it_was_fitted_to():
    """seed-math500 was fitted to 1.6 % of MATH-500 responses clipped at 12,288 tokens: its log-normal gives
    that figure, and 40,000 draws follow that log-normal (at a cap far above it and at the recipes' cap)."""
    spec, n = "seed-math500", 40_000
    assert round(length_stats.above(spec, 12_288), 3) == 0.016  # the fit, to the figure's stated precision
    draws = [lengths.draw(spec, 10**6, 0, 1, str(i)) for i in range(n)]
    # a draw is above 12,288 when L rounds above it: L >= 12,288.5
    length_stats.assert_share(sum(d > 12_288 for d in draws), n, length_stats.above(spec, 12_288.5), "above 12,288")
    cap = OmegaConf.load(REPO / "recipes" / "base.yaml").data.max_response_length
    length_stats.assert_follows(spec, [min(d, cap) for d in draws], cap)


def test_draws_are_deterministic_clipped_and_keyed():
    a = [lengths.draw("lognormal:100:1.0", 150, 3, 2, f"k{i}") for i in range(200)]
    assert a == [lengths.draw("lognormal:100:1.0", 150, 3, 2, f"k{i}") for i in range(200)]
    assert min(a) >= 1 and max(a) == 150 and len(set(a)) > 50
    assert a != [lengths.draw("lognormal:100:1.0", 150, 4, 2, f"k{i}") for i in range(200)]  # seed
    assert a != [lengths.draw("lognormal:100:1.0", 150, 3, 3, f"k{i}") for i in range(200)]  # step
    assert lengths.draw("cap", 77, 0, 1, "x") == 77 and lengths.draw("lognormal:5:0", 77, 0, 1, "y") == 5
    # the quantile map is the log-normal's: the draw at u is median * exp(sigma * z(u))
    z = NormalDist().inv_cdf(0.9)
    draws = sorted(lengths.draw("lognormal:1000:0.5", 10**6, 0, 1, str(i)) for i in range(20_000))
    assert abs(draws[int(0.9 * len(draws))] / (1000 * math.exp(0.5 * z)) - 1) < 0.02


def test_schedules_and_refusals():
    sched = lengths.schedule("cap@2,seed-math500@1,lognormal:12:1")
    assert sched == [("cap", 2), ("seed-math500", 1), ("lognormal:12:1", None)]
    assert [lengths.profile_at(sched, s) for s in (1, 2, 3, 4, 9)] == ["cap", "cap", "seed-math500"] + ["lognormal:12:1"] * 2
    assert [lengths.profile_at(lengths.schedule("cap@1,seed-math500@1"), s) for s in (1, 2, 3)] == ["cap"] + ["seed-math500"] * 2
    for bad in ("math", "lognormal:0:1", "lognormal:10", "lognormal:a:b", "seed-math500,cap"):
        with pytest.raises(ValueError, match="length (profile|schedule)"):
            lengths.schedule(bad)


@pytest.mark.fresh_process
def test_bench_refuses_a_bad_profile_before_anything_starts(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "tools.bench", "--phase", "step", "--size", "cpu", "--lengths",
                           "lognormal:-3:1", "--out", str(tmp_path / "b.json"), "--workdir", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode != 0 and "--lengths (LENGTHS=)" in proc.stderr and "MEDIAN > 0" in proc.stderr, proc.stderr
    assert not (tmp_path / "b.json").exists() and not list(tmp_path.glob("run_*"))


def test_agent_loop_file_is_what_upstream_reads(tmp_path):
    from omegaconf import OmegaConf

    path = lengths.write_config(tmp_path / "loop.yaml", "cap@1,seed-math500", seed=7, log=tmp_path / "log.jsonl")
    (entry,) = OmegaConf.load(path)  # as AgentLoopWorker loads agent_loop_config_path
    assert entry.name == lengths.NAME and entry._target_ == lengths.FQN and entry.seed == 7
    assert lengths.overrides(path) == [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}",
                                       "actor_rollout_ref.rollout.agent.default_agent_loop=length_profile"]


# The smoke overlay's cap is 32 tokens: step 1 at the cap, step 2 from a log-normal of median 10 under it.
PROFILE = "cap@1,lognormal:10:0.6"


def _lengths_spec(out: Path) -> Spec:
    return Spec(argv=[sys.executable, "-m", "tools.bench", "--phase", "step", "--size", "cpu", "--recipe", "k1",
                      "--steps", "2", "--save-after", "0", "--rollout", "hf", "--lengths", PROFILE,
                      "--out", str(out / "bench.json"), "--workdir", str(out / "work"), "--timeout", "600"], timeout=900)


bench_lengths_run = shared_run("bench_lengths_run", _lengths_spec)


@pytest.mark.slow
def test_rollout_generates_the_lengths_the_profile_asks_for(bench_lengths_run):
    """A real k1 bench run on the hf rollout: VERL's own response-length metrics of each step equal what the
    bench-only agent loop asked for (mean, min, max), step 1 at the cap, step 2 spread under it."""
    out = bench_lengths_run.out
    assert bench_lengths_run.returncode == 0, bench_lengths_run.log[-3000:]
    r = json.loads((out / "bench.json").read_text())["phases"]["step"]["recipes"]["k1"]
    assert r["lengths"] == PROFILE and r["steps_done"] == 2, r
    s1, s2 = r["steps"]
    assert s1["lengths"] == "cap" and s1["requested_tokens/min"] == s1["requested_tokens/max"] == 32
    assert s2["lengths"] == "lognormal:10:0.6" and s2["requested_tokens/max"] < 32
    assert s2["requested_tokens/min"] < s2["requested_tokens/max"]  # a spread, not one length
    for s in (s1, s2):
        assert s["requests"] == 4  # 2 prompts x 2 samples (smoke overlay)
        assert abs(s["response_length/mean"] - s["requested_tokens/mean"]) < 0.06, s
        assert s["response_length/max"] == s["requested_tokens/max"] and s["response_length/min"] == s["requested_tokens/min"], s
    log = (out / "work" / "run_k1" / "run.log").read_text(errors="replace")
    assert "default_agent_loop=length_profile" in " ".join(r["overrides"]), log[-2000:]
