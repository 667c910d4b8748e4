"""Bench phase `specdecode`: the rollout's decode with and without speculation, against the drafts' acceptance.

    python -m tools.bench.spec_decode [--batches 32 8 1] [--tokens 1024] [--temperatures 1 0.25 0.1 0.05]
        [--spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}']
        [--compile rollout|default|full|piecewise] [--workdir .cache/bench] [--out bench.json]

One engine per child process, plain then speculative, on the random R1-Distill-1.5B-architecture model
(opd_patches/embedded/r1_arch.py) with the rollout's memory share (0.5) and, with `--compile rollout`, its
compilation (recipes/device/gpu.yaml: CUDA graphs for one-token decode, no torch.compile); `default` is vLLM's
own, `full` and `piecewise` are torch.compile (VLLM_COMPILE) with those CUDA-graph modes. For each batch size B
and temperature T: B prompts x `--tokens` forced new tokens (EOS ignored, per-request seeds).

The acceptance is set by the temperature. Random weights at T = 1 give near-uniform tokens: ngram finds
nothing to propose (an idle proposer). Sampling at T = 1/s is sampling at T = 1 from the same model with its
lm_head scaled by s: peaked enough to fall into repetition loops, so drafts are proposed and, the lower T, the
more of them accepted, while every draft still goes through the rejection test. Each row: the seconds, ms per
output token of one sequence (an engine step without speculation), the engine's start-up, and from vLLM's
counters the drafts, drafted and accepted tokens and the mean accepted length (1 + accepted / drafts); a
speculative row's `ratio` is its time over the plain row's at the same B and T: below 1 speculation pays.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from opd_patches.rollout import spec_metrics

REPO = Path(__file__).resolve().parents[2]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
COMPILE = {"rollout": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}, "default": None,
           "full": {"mode": 3, "cudagraph_mode": "FULL"}, "piecewise": {"mode": 3, "cudagraph_mode": "PIECEWISE"}}


def counters(llm) -> dict[str, float]:
    """vLLM's spec-decode counters of an offline engine: drafts, drafted and accepted tokens (0 without speculation)."""
    return spec_metrics.totals((m.name, getattr(m, "value", None)) for m in llm.get_metrics())


def child(args) -> list[dict]:
    """One engine (plain or speculative): a row per (batch, temperature)."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(args.spec) if args.engine == "spec" else None
    cc = COMPILE[args.compile]
    start = time.monotonic()
    llm = LLM(model=str(args.model), dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=64 + args.tokens + 16,
              seed=0, disable_log_stats=False, **({"compilation_config": cc} if cc else {}),
              **({"speculative_config": spec} if spec else {}))
    startup = time.monotonic() - start
    rows = []
    for temperature in args.temperatures:
        for batch in args.batches:
            prompts = [TokensPrompt(prompt_token_ids=[(1000 + 7 * i + j) % 150000 for j in range(64)]) for i in range(batch)]
            params = [SamplingParams(temperature=temperature, max_tokens=args.tokens, min_tokens=args.tokens,
                                     ignore_eos=True, seed=i) for i in range(batch)]
            llm.generate(prompts[:1], params[:1], use_tqdm=False)  # this shape's first run pays one-time costs
            before = counters(llm)
            t0 = time.monotonic()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.monotonic() - t0
            after = counters(llm)
            made = min(len(o.outputs[0].token_ids) for o in outs)
            drafts, drafted, accepted = (after[k] - before[k] for k in ("drafts", "drafted", "accepted"))
            rows.append({"engine": args.engine, "batch": batch, "temperature": temperature, "tokens": made,
                         "seconds": round(seconds, 3), "ms_per_token": round(1e3 * seconds / args.tokens, 3),
                         "startup_s": round(startup, 1), "drafts": drafts, "drafted": drafted, "accepted": accepted,
                         "accept_rate": round(accepted / drafted, 4) if drafted else None,
                         "accept_length": round(1 + accepted / drafts, 4) if drafts else None})
            print(f"[bench specdecode] {args.engine} B={batch} T={temperature}: {rows[-1]}", flush=True)
    return rows


def pair_rows(rows: list[dict], compile_name: str) -> list[dict]:
    """The bench's rows: each speculative measurement against the plain one at the same batch and temperature."""
    plain = {(r["batch"], r["temperature"]): r for r in rows if r["engine"] == "plain"}
    out = []
    for r in rows:
        ref = plain.get((r["batch"], r["temperature"])) if r["engine"] == "spec" else None
        out.append({"name": f"specdecode/{compile_name}/{r['engine']}/b{r['batch']}/T{r['temperature']:g}",
                    "time_s": r["seconds"], "ref_time_s": ref["seconds"] if ref else None,
                    "ratio": round(r["seconds"] / ref["seconds"], 3) if ref else None,
                    "tok_per_s": r["batch"] * r["tokens"] / r["seconds"] if r["seconds"] else None, "peak_gib": None, **r})
    return out


def run_phase(args) -> dict:
    workdir = Path(getattr(args, "workdir", None) or REPO / ".cache" / "bench")
    # drawn in a child: a CUDA draw here would hold its context and cached memory beside both engines
    subprocess.run([sys.executable, "-m", "opd_patches.embedded.r1_arch", "--out", str(workdir / "r1_arch"),
                    "--seeds", "0", "--device", "cuda"], check=True, cwd=REPO)
    model = workdir / "r1_arch" / "seed0"
    spec = getattr(args, "spec", None) or json.dumps(NGRAM)
    compile_name = getattr(args, "compile", None) or "rollout"
    batches = getattr(args, "batches", None) or [32, 8, 1]
    tokens = getattr(args, "tokens", None) or 1024
    temperatures = getattr(args, "temperatures", None) or [1.0, 0.25, 0.1, 0.05]
    rows = []
    for engine in ("plain", "spec"):
        out = workdir / f"specdecode-{engine}.json"
        cmd = [sys.executable, "-m", "tools.bench.spec_decode", "child", "--engine", engine, "--model", str(model),
               "--spec", spec, "--compile", compile_name, "--tokens", str(tokens), "--out", str(out),
               "--batches", *map(str, batches), "--temperatures", *map(str, temperatures)]
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            raise RuntimeError(f"specdecode: the {engine} engine failed")
        rows += json.loads(out.read_text())
    return {"size": "full", "rows": pair_rows(rows, compile_name), "spec": json.loads(spec), "compile": compile_name,
            "notes": ["ratio: the speculative engine's seconds over the plain engine's at the same batch and temperature",
                      "T = 1/s samples the model with its lm_head scaled by s at T = 1: the acceptance rises as T falls"]}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[32, 8, 1])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.25, 0.1, 0.05])
    p.add_argument("--spec", default=json.dumps(NGRAM), help="speculative_config as JSON")
    p.add_argument("--compile", choices=sorted(COMPILE), default="rollout")
    p.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench")
    p.add_argument("--out", type=Path, default=Path("bench.json"))
    if argv[:1] == ["child"]:
        p.add_argument("--engine", choices=("plain", "spec"), required=True)
        p.add_argument("--model", type=Path, required=True)
        a = p.parse_args(argv[1:])
        a.out.write_text(json.dumps(child(a)))
        return 0
    a = p.parse_args(argv)
    from tools.bench import results

    entry = run_phase(a)
    results.report(a.out, "specdecode", entry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
