"""generations.jsonl records -> results mappings and the summary JSON.

A record (one line of `<out>/generations.jsonl`, one sampled answer):
    {"id", "sample", "source", "gold", "response", "n_tokens", "finish_reason", "truncated",
     "unfinished_thought", "extracted", "correct", "grader": "rule"|"verifier", "decided_by", "reason", ...}

`load_records` reads the file and tolerates a cut-off last line (an interrupted run); `results` turns
records into the `{question_id: [0/1, ...]}` mapping `opd_patches.eval.stats` works on. `summarize` gives:
pass@1 (each question weighted equally), `se_clustered` (std of per-question means / sqrt(questions):
THE uncertainty; the naive binomial SE is kept only as a labelled diagnostic), `truncation_rate`
(samples that hit the token cap / all samples), `n_unfinished_thought` (samples that ended inside a
thought, scored 0 by the grader; most are truncated ones), the same per source file (e.g. aime24 and aime25),
counts of who decided (`graders`), mean response length, and whether every (question, sample) pair of
the protocol is present (`complete`).
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path

from opd_patches.eval import stats

_STEP_RE = re.compile(r"global_step_(\d+)")


def load_records(path: Path) -> tuple[list[dict], int]:
    """(records, number of unreadable lines dropped) of a generations.jsonl (missing file: none)."""
    path = Path(path)
    if not path.exists():
        return [], 0
    records, bad = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            bad += 1
    return records, bad


def results(records: list[dict]) -> dict:
    """{question_id: [1.0/0.0 per sample, in sample order]}."""
    by_q = defaultdict(dict)
    for r in records:
        by_q[r["id"]][r["sample"]] = float(bool(r["correct"]))
    return {q: [s[k] for k in sorted(s)] for q, s in by_q.items()}


def step_of(model: str) -> int | None:
    """The training step of a checkpoint path (`.../global_step_N/...`), else None."""
    found = _STEP_RE.findall(str(model))
    return int(found[-1]) if found else None


def _block(records: list[dict]) -> dict:
    p = stats.pass_at_1(results(records))
    return {
        "pass_at_1": p["mean"],
        "se_clustered": p["clustered_se"],
        "n_questions": p["n_questions"],
        "n_samples": p["n_samples"],
        "truncation_rate": stats.truncation_rate([bool(r["truncated"]) for r in records]),
        "n_unfinished_thought": sum(bool(r.get("unfinished_thought")) for r in records),
    }


def summarize(records: list[dict], config: dict, n_expected: int, elapsed_s: float | None = None) -> dict:
    """The summary JSON of one evaluation (`config` is the run's eval_config.json content)."""
    if not records:
        raise ValueError("no graded samples to summarise")
    p = stats.pass_at_1(results(records))
    by_source = defaultdict(list)
    for r in records:
        by_source[r.get("source", "all")].append(r)
    return {
        "suite": config["suite"],
        "model": config["model"],
        "model_hash": config.get("model_hash"),
        "step": config.get("step"),
        **_block(records),
        "naive_binomial_se": p["naive_binomial_se"],
        "naive_binomial_se_note": p["naive_binomial_se_note"],
        "per_source": {s: _block(rs) for s, rs in sorted(by_source.items())} if len(by_source) > 1 else {},
        "graders": dict(Counter(f"{r['grader']}:{r['decided_by']}" for r in records)),
        "mean_response_tokens": sum(r["n_tokens"] for r in records) / len(records),
        "complete": len(records) == n_expected,
        "n_expected_samples": n_expected,
        "protocol": {k: config[k] for k in ("samples", "max_new_tokens", "temperature", "top_p", "seed", "limit")},
        "backend": config.get("backend"),
        "gpu_memory_utilization": config.get("gpu_memory_utilization"),
        "verifier": config.get("verifier"),
        "elapsed_s": elapsed_s,
        "written_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
