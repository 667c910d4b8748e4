"""Response-length profiles for `make bench PHASE=step LENGTHS=...` (BENCH ONLY, never active in training).

Random weights never sample EOS, so every response of a bench step runs to the cap and every sequence
ends at the same moment: the worst case. A profile gives each response a length drawn from a named
distribution instead, and the rollout generates exactly that many tokens: `LengthProfileAgentLoop`
(length_agent_loop.py: upstream's single-turn agent loop, named in the `agent_loop_config_path` file upstream
reads, never registered by opd_patches.register) puts `max_tokens` = the drawn length and `ignore_eos` into each request's
sampling parameters, which VERL's vLLM server and the hf backend both honour per request.

A draw is a function of (seed, step, prompt, row index, sample number): the same sample of the same
step gets the same length in every run (k1 and topk batch different prompts, so their draws differ). Lengths are clipped to the run's
`data.max_response_length` (the cap), as a real run's are.

Profiles (PROFILES; `lognormal:MEDIAN:SIGMA` for any other):
- `seed-math500`: log-normal, median 4,206 tokens, sigma 0.5. Fit: the seed run's one reported length
  statistic, 1.6 % of MATH-500 responses of R1-Distill-Qwen-1.5B clipped at 12,288 tokens
  (P(L > 12,288) = 0.016 gives median = 12,288 / exp(2.144 sigma)); sigma 0.5 is an assumption, not a fit
  (no per-response lengths of the real model are available here; mean 4,766 tokens). At the
  recipes' 7,168 cap it clips 14.3 % of responses, mean 4,432 tokens.
- `cap`: every response at the cap (what random weights do anyway: the baseline row).
A schedule `cap@2,seed-math500@2` runs steps 1-2 at the cap and 3-4 at the profile within one run
(one start-up for both rows: a vLLM run takes minutes to start, docs/performance.md).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from statistics import NormalDist

NAME = "length_profile"  # the agent loop's name in upstream's registry (rollout.agent.default_agent_loop)
FQN = "opd_patches.hooks.length_agent_loop.LengthProfileAgentLoop"

# name -> (median tokens, sigma of log L, where the numbers come from)
PROFILES = {
    "seed-math500": (4206.0, 0.5, "seed: 1.6 % of MATH-500 responses clipped at 12,288 tokens; sigma 0.5 assumed"),
}


def parse(spec: str) -> tuple[float, float] | None:
    """(median, sigma) of a profile name or `lognormal:MEDIAN:SIGMA`; None for `cap`."""
    if spec == "cap":
        return None
    if spec in PROFILES:
        return PROFILES[spec][:2]
    parts = spec.split(":")
    if parts[0] == "lognormal" and len(parts) == 3:
        try:
            median, sigma = float(parts[1]), float(parts[2])
        except ValueError:
            median = sigma = -1.0
        if median > 0 and sigma >= 0:
            return median, sigma
    raise ValueError(f"length profile {spec!r}: choose cap, one of {sorted(PROFILES)}, or lognormal:MEDIAN:SIGMA "
                     "(MEDIAN > 0 tokens, SIGMA >= 0)")


def schedule(spec: str) -> list[tuple[str, int | None]]:
    """`cap@2,seed-math500@2` -> [("cap", 2), ("seed-math500", 2)]; a lone profile runs every step."""
    out = []
    for item in (x.strip() for x in spec.split(",")):
        head, _, tail = item.rpartition("@")
        name, steps = (head, int(tail)) if head and tail.isdigit() else (item, None)
        parse(name)  # refuse a bad name before anything starts
        out.append((name, steps))
    if any(n is None for _, n in out[:-1]):
        raise ValueError(f"length schedule {spec!r}: every profile but the last needs a step count (NAME@STEPS)")
    return out


def profile_at(sched: list[tuple[str, int | None]], step: int) -> str:
    """The profile of training step `step` (1-based); the last one carries on."""
    end = 0
    for name, steps in sched:
        if steps is None:
            return name
        end += steps
        if step <= end:
            return name
    return sched[-1][0]


def draw(spec: str, cap: int, seed: int, step: int, key: str) -> int:
    """The length (1..cap) of one response: the profile's quantile at a uniform from sha256(seed, step, key)."""
    params = parse(spec)
    if params is None:
        return cap
    median, sigma = params
    h = hashlib.sha256(f"{seed}|{step}|{key}".encode()).digest()
    u = (int.from_bytes(h[:8], "big") + 0.5) / 2**64  # in (0, 1)
    tokens = median * math.exp(sigma * NormalDist().inv_cdf(u))
    return max(1, min(cap, int(round(tokens))))


def write_config(path: Path, spec: str, seed: int = 0, log: Path | None = None) -> Path:
    """The agent-loop file upstream reads (`actor_rollout_ref.rollout.agent.agent_loop_config_path`)."""
    schedule(spec)
    entry = {"name": NAME, "_target_": FQN, "spec": spec, "seed": seed, "log": str(log) if log else None}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([entry], indent=1) + "\n")  # JSON is YAML: OmegaConf.load reads it
    return path


def overrides(config_file: Path) -> list[str]:
    """Hydra overrides that make every rollout request go through the profile's agent loop."""
    return [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={config_file}",
            f"actor_rollout_ref.rollout.agent.default_agent_loop={NAME}"]
