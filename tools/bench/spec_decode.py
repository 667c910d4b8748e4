"""The decode bench: the rollout's decode with and without speculation, against the drafts' acceptance.

    python -m tools.bench.spec_decode [--model random|echo] [--batches 32 8 1] [--tokens 1024] [--temperatures ...]
        [--spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}']
        [--compile rollout|mode0|default|piecewise] [--seeds request|none] [--workdir .cache/bench] [--out bench.json]

One engine per child process, plain then speculative, on an R1-Distill-1.5B-architecture model with the rollout's
memory share (0.5) and, with `--compile rollout`, its compilation (recipes/device/gpu.yaml: torch.compile,
VLLM_COMPILE, with full graphs for uniform decode and piecewise ones for the rest); `default` is vLLM's own (the
same under vLLM 0.24), `piecewise` mode 3 with piecewise graphs only, `mode0` CUDA graphs for one-token decode
without torch.compile (under speculation such a graph serves a step only when every sequence in it verifies exactly
1 + k tokens, the other steps run eager). Full graphs for every batch (`cudagraph_mode` FULL) are no choice here:
they changed the samples (opd_patches/checks/compilation.py). For each batch size B and temperature T: B prompts x
`--tokens` forced new tokens (EOS ignored). `--seeds request` (default) gives every request its own seed, so a row's
tokens repeat from run to run; `none` samples as the rollout does (VERL sets a request's seed only under
`rollout.full_determinism`): vLLM draws seeded requests' random numbers one request at a time.

Two models of the same compute per token:

- `random` (default; opd_patches/embedded/r1_arch.py, seed 0): random weights propose almost no drafts, at low
  temperatures too (a low temperature makes each choice near-greedy, not repetitive), so ngram is an idle
  proposer and the speculative rows are the cost of speculating at zero acceptance. Default T: 1.
- `echo` (tools/bench/echo_model.py, written from `random`): the same weights with every layer's output projections
  zero and lm_head a scaled copy of the embedding, so the model repeats its last token with a probability r(T)
  and otherwise jumps to an almost uniformly drawn other token. The shapes, dtypes and kernels are those of
  `random` (zeros cost what random weights cost): a step's compute is unchanged and the temperature sets the
  acceptance. Every ngram draft repeats the current token (the earliest match of the run's suffix lies inside the
  run) and is accepted with probability r, so a full draft of k = 4 tokens gives a mean accepted length per
  verification step of 1 + r + r^2 + r^3 + r^4. Drafts are shorter while the current run is short (a run of L
  tokens matches its last n = min(4, L - 1) and drafts min(k, L - n): nothing before L = 3, four from L = 8), so
  vLLM's mean accepted length lies below that sum, and the share of steps that speculate grows with r. The
  default temperatures span r from near 0 to near 1 within vLLM's range of temperatures, the rollout's T = 1
  among them (`echo_model.repeat_probability` computes r(T) from the checkpoint; each echo row records its r as
  `repeat_p`, the mean over tokens drawn uniformly, which runs that dwell on a token weight a little
  differently). r(T) rests on the embedding's scale (initializer range, hidden size) and the lm_head's SCALE, not on
  the draw.

Each row: the seconds, ms per output token of one sequence (an engine step without speculation), the engine's
start-up, and from vLLM's counters the drafts, drafted and accepted tokens and the mean accepted length
(1 + accepted / drafts); a speculative row's `ratio` is its time over the plain row's at the same B and T: below
1 speculation pays. Rows are named specdecode/<compile>/<engine>/b<B>/T<T> for `random` and
specdecode/<compile>/echo/<engine>/b<B>/T<T> for `echo`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from opd_patches.eval.vllm_backend import ROLLOUT_COMPILATION
from opd_patches.rollout import spec_metrics

REPO = Path(__file__).resolve().parents[2]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
COMPILE = {"rollout": ROLLOUT_COMPILATION, "default": None,
           "piecewise": {"mode": 3, "cudagraph_mode": "PIECEWISE"},
           "mode0": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}
# echo: from almost no repeats to almost only repeats (r(T) in the module docstring)
TEMPERATURES = {"random": [1.0], "echo": [2.0, 1.3, 1.15, 1.0, 0.5]}


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
    llm = LLM(model=str(args.path), dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=64 + args.tokens + 16,
              seed=0, disable_log_stats=False, **({"compilation_config": dict(cc)} if cc else {}),
              **({"speculative_config": spec} if spec else {}))
    startup = time.monotonic() - start
    rows = []
    for temperature in args.temperatures or TEMPERATURES[args.model]:
        for batch in args.batches:
            prompts = [TokensPrompt(prompt_token_ids=[(1000 + 7 * i + j) % 150000 for j in range(64)]) for i in range(batch)]
            params = [SamplingParams(temperature=temperature, max_tokens=args.tokens, min_tokens=args.tokens,
                                     ignore_eos=True, seed=i if args.seeds == "request" else None)
                      for i in range(batch)]
            llm.generate(prompts[:1], params[:1], use_tqdm=False)  # this shape's first run pays one-time costs
            before = counters(llm)
            t0 = time.monotonic()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.monotonic() - t0
            after = counters(llm)
            made = min(len(o.outputs[0].token_ids) for o in outs)
            drafts, drafted, accepted = (after[k] - before[k] for k in ("drafts", "drafted", "accepted"))
            rows.append({"model": args.model, "engine": args.engine, "batch": batch, "temperature": temperature,
                         "seeds": args.seeds,
                         "tokens": made, "seconds": round(seconds, 3), "ms_per_token": round(1e3 * seconds / args.tokens, 3),
                         "startup_s": round(startup, 1), "drafts": drafts, "drafted": drafted, "accepted": accepted,
                         "accept_rate": round(accepted / drafted, 4) if drafted else None,
                         "accept_length": round(1 + accepted / drafts, 4) if drafts else None})
            print(f"[bench specdecode] {args.model} {args.engine} B={batch} T={temperature}: {rows[-1]}", flush=True)
    return rows


def row_name(compile_name: str, model: str, engine: str, batch: int, temperature: float) -> str:
    """`random` rows keep the names they had before there was a choice of model."""
    return "/".join(["specdecode", compile_name, *([] if model == "random" else [model]), engine, f"b{batch}",
                     f"T{temperature:g}"])


def pair_rows(rows: list[dict], compile_name: str) -> list[dict]:
    """The bench's rows: each speculative measurement against the plain one of its model, batch and temperature."""
    def key(r):
        return r.get("model", "random"), r["batch"], r["temperature"]

    plain = {key(r): r for r in rows if r["engine"] == "plain"}
    out = []
    for r in rows:
        ref = plain.get(key(r)) if r["engine"] == "spec" else None
        out.append({"name": row_name(compile_name, r.get("model", "random"), r["engine"], r["batch"], r["temperature"]),
                    "time_s": r["seconds"], "ref_time_s": ref["seconds"] if ref else None,
                    "ratio": round(r["seconds"] / ref["seconds"], 3) if ref else None,
                    "tok_per_s": r["batch"] * r["tokens"] / r["seconds"] if r["seconds"] else None, "peak_gib": None, **r})
    return out


def model_folder(workdir: Path, model: str) -> Path:
    """The checkpoint of `model` under `workdir`, built on first use (the echo copy from the random one)."""
    # drawn in a child: a CUDA draw here would hold its context and cached memory beside both engines
    subprocess.run([sys.executable, "-m", "opd_patches.embedded.r1_arch", "--out", str(workdir / "r1_arch"),
                    "--seeds", "0", "--device", "cuda"], check=True, cwd=REPO)
    folder = workdir / "r1_arch" / "seed0"
    if model == "echo":
        from tools.bench import echo_model

        echo = workdir / "r1_arch" / f"echo0-scale{echo_model.SCALE:g}"  # a copy written at another scale is not reused
        if not echo.exists():
            echo_model.write_echo(folder, echo)
        folder = echo
    return folder


def check_temperatures(temperatures) -> None:
    """Refused before any engine starts: a temperature the installed vLLM's sampling parameters do not accept."""
    try:
        from vllm import SamplingParams
    except ImportError:  # no vLLM here: nothing to check against, and no engine will start
        return
    for t in temperatures:
        try:
            SamplingParams(temperature=t)
        except ValueError as exc:
            raise SystemExit(f"[bench specdecode] --temperatures {t:g}: {exc}") from None


def run_phase(args) -> dict:
    workdir = Path(getattr(args, "workdir", None) or REPO / ".cache" / "bench")
    model = getattr(args, "model", None) or "random"
    temperatures = getattr(args, "temperatures", None) or TEMPERATURES[model]
    check_temperatures(temperatures)
    folder = model_folder(workdir, model)
    spec = getattr(args, "spec", None) or json.dumps(NGRAM)
    compile_name = getattr(args, "compile", None) or "rollout"
    batches = getattr(args, "batches", None) or [32, 8, 1]
    tokens = getattr(args, "tokens", None) or 1024
    seeds = getattr(args, "seeds", None) or "request"
    rows = []
    for engine in ("plain", "spec"):
        out = workdir / f"specdecode-{model}-{engine}.json"
        cmd = [sys.executable, "-m", "tools.bench.spec_decode", "child", "--engine", engine, "--model", model,
               "--path", str(folder), "--spec", spec, "--compile", compile_name, "--tokens", str(tokens),
               "--seeds", seeds, "--out", str(out), "--batches", *map(str, batches),
               "--temperatures", *map(str, temperatures)]
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            raise RuntimeError(f"specdecode: the {engine} engine failed")
        rows += json.loads(out.read_text())
    notes = ["ratio: the speculative engine's seconds over the plain engine's at the same batch and temperature"]
    if model == "echo":
        from tools.bench import echo_model

        repeat = echo_model.repeat_probability(folder, temperatures)
        for r in rows:
            r["repeat_p"] = round(repeat[float(r["temperature"])], 4)
        notes.append("echo: repeat_p = r(T), the chance of repeating the last token, which each drafted repeat is "
                     "accepted with; a full draft of 4 gives an accepted length of 1 + r + r^2 + r^3 + r^4")
    else:
        notes.append("random: each speculative row costs speculating at the acceptance its drafted and accepted counts show")
    return {"size": "full", "model": model, "rows": pair_rows(rows, compile_name), "spec": json.loads(spec),
            "compile": compile_name, "seeds": seeds, "notes": notes}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[32, 8, 1])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--model", choices=sorted(TEMPERATURES), default="random",
                   help="random weights, or their echo copy (tools/bench/echo_model.py)")
    p.add_argument("--temperatures", type=float, nargs="+", help=f"default: per model, {TEMPERATURES}")
    p.add_argument("--spec", default=json.dumps(NGRAM), help="speculative_config as JSON")
    p.add_argument("--compile", choices=sorted(COMPILE), default="rollout")
    p.add_argument("--seeds", choices=("request", "none"), default="request",
                   help="a seed per request (repeatable rows), or none as in the rollout")
    p.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench")
    p.add_argument("--out", type=Path, default=Path("bench.json"))
    if argv[:1] == ["child"]:
        p.add_argument("--engine", choices=("plain", "spec"), required=True)
        p.add_argument("--path", type=Path, required=True, help="the model's checkpoint folder")
        a = p.parse_args(argv[1:])
        a.out.write_text(json.dumps(child(a)))
        return 0
    a = p.parse_args(argv)
    from tools.bench import results

    entry = run_phase(a)
    # one phase per model and compilation: a later run into the same file keeps the others' rows
    name = "-".join(["specdecode", a.compile, *([] if a.model == "random" else [a.model]),
                     *([] if a.seeds == "request" else ["unseeded"])])
    results.report(a.out, name, entry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
