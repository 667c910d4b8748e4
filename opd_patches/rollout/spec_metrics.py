"""The rollout's speculative decoding per training step, from vLLM's own counters.

Upstream's `rollout/spec_accept_rate` and `rollout/spec_accept_length` come from per-request statistics that
vLLM 0.24 does not report, and only for MTP. vLLM's engine counts its drafts, drafted tokens and accepted tokens
in Prometheus counters, which each rollout server (VERL's HTTP server around the engine) serves at `/metrics`
while the engine logs statistics: `main.apply_speculation` turns `actor_rollout_ref.rollout.disable_log_stats`
off when a `speculative_config` is given. The trainer reads the counters of every server before and after a
step and logs the difference beside `timing_s/gen`:

- `rollout/spec_drafted_tokens`, `rollout/spec_accepted_tokens`: the step's totals over all servers;
- `rollout/spec_engine_accept_rate`: accepted / drafted tokens (token-weighted over the step);
- `rollout/spec_engine_accept_length`: 1 + accepted tokens / drafts, the tokens one verification step yields
  on average (1.0: no draft ever kept; a step costs about as much as without speculation plus the drafting).
"""

from __future__ import annotations

import http.client
import urllib.request

COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "drafted": "vllm:spec_decode_num_draft_tokens",
            "accepted": "vllm:spec_decode_num_accepted_tokens"}


_KEYS = {name + suffix: key for key, name in COUNTERS.items() for suffix in ("", "_total")}


def totals(samples) -> dict[str, float]:
    """The counters' totals, summed over label sets (engines, models), from (name, value) pairs: a Prometheus
    page's samples, or the metrics of vLLM's offline `LLM.get_metrics()` (the tools' engines)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for name, value in samples:
        if name in _KEYS and value is not None:
            out[_KEYS[name]] += value
    return out


def parse(text: str) -> dict[str, float]:
    """The counters' totals from a Prometheus text exposition (a server's /metrics). A speculating engine exposes
    its counters at 0 from its start, so a page without them (an engine that does not speculate, or counters
    renamed upstream) raises ValueError rather than passing for a step without drafts."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [(s.name, s.value) for family in text_string_to_metric_families(text) for s in family.samples]
    missing = set(COUNTERS.values()) - {name.removesuffix("_total") for name, _ in samples}
    if missing:
        raise ValueError(f"no {', '.join(sorted(missing))} on the page")
    return totals(samples)


# The servers are this cluster's own: a proxy from the environment must not stand in between.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def read(addresses: list[str], timeout_s: float = 5.0) -> dict[str, float] | None:
    """The counters summed over the servers at `addresses` ("host:port"); None when one cannot be read or
    parsed or lacks the counters (the step then logs no speculation figures; training goes on)."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for address in addresses:
        try:
            with _OPENER.open(f"http://{address}/metrics", timeout=timeout_s) as response:
                counts = parse(response.read().decode())
        except (OSError, http.client.HTTPException, ValueError):
            return None
        for key, value in counts.items():
            totals[key] += value
    return totals


def step_metrics(before: dict | None, after: dict | None) -> dict[str, float]:
    """The step's figures from the counters read before and after it ({} when either read failed)."""
    if before is None or after is None:
        return {}
    d = {key: after[key] - before[key] for key in COUNTERS}
    out = {"rollout/spec_drafted_tokens": d["drafted"], "rollout/spec_accepted_tokens": d["accepted"]}
    if d["drafted"] > 0:
        out["rollout/spec_engine_accept_rate"] = d["accepted"] / d["drafted"]
    if d["drafts"] > 0:
        out["rollout/spec_engine_accept_length"] = 1.0 + d["accepted"] / d["drafts"]
    return out
