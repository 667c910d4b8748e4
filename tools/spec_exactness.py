"""Whether vLLM's speculative decoding keeps the student's sampling distribution: samples with and without it.

    python -m tools.spec_exactness --model .cache/addition/student [--samples 4000] [--prompts 4]
        [--positions 2,3,4,8,16] [--spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}' | none] [--spec-compilation '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}']
        [--alpha 0.01] [--bias 0.2] [--min-shift 0.1] [--out outputs/spec_exactness.json] [--reuse]

For each of the known-answer task's first `--prompts` held-out questions (the model's chat template), two
engines draw `--samples` continuations at temperature 1: one plain, one with `--spec` (the checked engine),
each in its own child process with disjoint per-request seeds, so that the two sets are independent. The
plain engine runs the training rollout's compilation settings (opd_patches/eval/vllm_backend.py), the checked
one `--spec-compilation` (by default the same). `--spec none` checks a compilation setting alone: the checked
engine then drafts nothing. At each position of `--positions` (the
first token comes from the prompt's pass, never from a draft), the tokens there of the two sets are compared
by a chi-square test of homogeneity over the most frequent tokens (`homogeneity`), at level `--alpha` over
all tests (Bonferroni). It compares each position's token distribution, not whole sequences. Three checks,
all needed for exit 0:
- exact: no test rejects plain against speculative;
- power: the same tests reject a planted biased sampler, the speculative samples with each tested token moved,
  with probability `--bias`, off the most frequent token there onto the second where the most frequent holds
  half the samples or more (a peaked position, as a trained model's), else onto the most frequent
  (`plant_bias`), at every test where that moves at least `--min-shift` of the probability
  (bias x the share moved);
- exercised: the checked engine's counters show drafted and accepted tokens (vLLM's spec-decode metrics);
  not asked of `--spec none`.
Each engine's samples are kept beside --out (`<out>.plain.json`, `<out>.spec.json`), with the log-prob vLLM
returned for each sampled token (tools/spec_logprobs.py compares those with the model's own); `--reuse` tests
the samples again without drawing (on any machine). Drawing needs a GPU and vLLM; the statistics run on a CPU too
(tests/test_spec_exactness.py).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tools.bench.spec_decode import NGRAM, counters

REPO = Path(__file__).resolve().parents[1]
MIN_EXPECTED = 5.0  # the chi-square approximation's usual floor per cell
MAX_CELLS = 10  # the most frequent tokens and the rest: a shift onto any one of them keeps its weight


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square with df degrees of freedom: the regularized upper incomplete gamma."""
    import torch

    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(x / 2.0, dtype=torch.float64)))


def homogeneity(a: list, b: list, max_cells: int = MAX_CELLS) -> dict:
    """Chi-square test that two independent samples of categories come from one distribution, over the
    `max_cells - 1` categories most frequent in both together (each with MIN_EXPECTED expected in either
    sample) and one cell for the rest (merged into the smallest kept cell when it expects fewer);
    {"stat", "df", "p"} (p 1.0 when fewer than two cells remain: nothing to compare)."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    n = na + nb
    cells, rest = [], [0, 0]
    for key, total in (ca + cb).most_common():
        if len(cells) < max_cells - 1 and min(total * na / n, total * nb / n) >= MIN_EXPECTED:
            cells.append([ca[key], cb[key]])
        else:
            rest[0] += ca[key]
            rest[1] += cb[key]
    if sum(rest):
        if min(sum(rest) * na / n, sum(rest) * nb / n) >= MIN_EXPECTED or not cells:
            cells.append(rest)
        else:
            smallest = min(cells, key=sum)
            smallest[0] += rest[0]
            smallest[1] += rest[1]
    if len(cells) < 2:
        return {"stat": 0.0, "df": 0, "p": 1.0}
    stat = 0.0
    for oa, ob in cells:
        total = oa + ob
        for observed, size in ((oa, na), (ob, nb)):
            expected = total * size / n
            stat += (observed - expected) ** 2 / expected
    df = len(cells) - 1
    return {"stat": stat, "df": df, "p": chi2_sf(stat, df)}


def token_at(samples: list[list[int]], position: int) -> list:
    """The token at 1-based `position` of each sample, or "end" for a sample that ended before it."""
    return [s[position - 1] if len(s) >= position else "end" for s in samples]


def plant_bias(samples: list[list[int]], positions: list[int], bias: float, seed: int = 0) -> tuple[list[list], dict]:
    """`samples` with the token at each of `positions` moved, with probability `bias`, from the most frequent
    token there onto the second where the most frequent holds at least half the samples, else from every
    other token onto the most frequent: a sampler whose marginal there is off by bias x the share moved
    (at least bias / 2; where one token holds every sample, a token never seen there takes its place), the
    shift returned per position."""
    rng = random.Random(seed)
    plan, shift = {}, {}  # position: (moves the top token away?, the top token, where a moved token goes)
    for k in positions:
        ranked = Counter(token_at(samples, k)).most_common(2)
        top, share = ranked[0][0], ranked[0][1] / len(samples)
        if len(ranked) < 2:  # one token only: the planted sampler sometimes writes a token never seen there
            plan[k], shift[k] = (True, top, "planted"), bias
        elif share >= 0.5:
            plan[k], shift[k] = (True, top, ranked[1][0]), bias * share
        else:
            plan[k], shift[k] = (False, top, top), bias * (1 - share)
    out = []
    for s in samples:
        s = list(s) + ["end"] * max(0, max(positions) - len(s))
        for k in positions:
            if (s[k - 1] == plan[k][1]) == plan[k][0] and rng.random() < bias:
                s[k - 1] = plan[k][2]
        out.append(s)
    return out, shift


def compare(plain: dict, spec: dict, positions: list[int], alpha: float, bias: float, min_shift: float) -> dict:
    """The exact and power checks over every prompt and position; `plain` and `spec` map a prompt to its samples."""
    tests, planted = [], []
    for prompt in plain:
        biased, shift = plant_bias(spec[prompt], positions, bias)
        for k in positions:
            tests.append({"prompt": prompt, "position": k,
                          **homogeneity(token_at(plain[prompt], k), token_at(spec[prompt], k))})
            planted.append({"prompt": prompt, "position": k, "shift": shift[k],
                            **homogeneity(token_at(plain[prompt], k), token_at(biased, k))})
    level = alpha / max(1, len(tests))
    detectable = [t for t in planted if t["shift"] >= min_shift]
    return {"level_per_test": level, "tests": tests, "planted": planted, "exact": all(t["p"] > level for t in tests),
            "planted_tests": len(detectable),
            "planted_rejected": bool(detectable) and all(t["p"] <= level for t in detectable)}


# ---- the GPU part -------------------------------------------------------------------------------------------
def prompts(model: str, n: int) -> list[str]:
    from transformers import AutoTokenizer

    from opd_patches.embedded import addition
    from opd_patches.task import prompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [prompt.render(tokenizer, q["problem"]) for q in addition.questions(n)]


def draw(args) -> dict:
    """Child: one engine's samples ({prompt: [[token ids], ...]}) and its spec-decode counters."""
    import os

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # as the evaluation backend, before vLLM's import
    from vllm import LLM, SamplingParams

    from opd_patches.eval.vllm_backend import ROLLOUT_COMPILATION

    spec = json.loads(args.spec) if args.engine == "spec" and args.spec != "none" else None
    checked = args.engine == "spec" and args.spec_compilation
    compilation = json.loads(args.spec_compilation) if checked else dict(ROLLOUT_COMPILATION)
    llm = LLM(model=args.model, dtype="auto", seed=0, max_model_len=1024, gpu_memory_utilization=0.3,
              compilation_config=dict(compilation), disable_log_stats=False,  # copies: vLLM fills in what it is given
              **({"speculative_config": dict(spec)} if spec else {}))
    texts = prompts(args.model, args.prompts)
    first = 0 if args.engine == "plain" else args.samples  # disjoint seeds: independent sets
    out, logprobs, prompt_ids = {}, {}, {}
    for text in texts:
        # logprobs=0: each sampled token's own log-prob, as the training rollout asks (tools/spec_logprobs.py)
        params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max(args.positions), seed=first + i,
                                 logprobs=0) for i in range(args.samples)]
        results = llm.generate([text] * args.samples, params, use_tqdm=False)
        out[text] = [list(r.outputs[0].token_ids) for r in results]
        logprobs[text] = [[step[token].logprob for token, step in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)]
                          for r in results]
        prompt_ids[text] = list(results[0].prompt_token_ids)
    return {"samples": out, "logprobs": logprobs, "prompt_ids": prompt_ids, "counters": counters(llm), "spec": spec,
            "compilation": compilation}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.spec_exactness", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / ".cache" / "addition" / "student"))
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--positions", default="2,3,4,8,16")
    ap.add_argument("--spec", default=json.dumps(NGRAM), help="speculative_config as JSON, or none")
    ap.add_argument("--spec-compilation", default=None,
                    help="the checked engine's compilation_config as JSON (default: the training rollout's)")
    ap.add_argument("--alpha", type=float, default=0.01)
    ap.add_argument("--bias", type=float, default=0.2)
    ap.add_argument("--min-shift", type=float, default=0.1, help="the planted bias must be rejected where it moves this much")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "spec_exactness.json")
    ap.add_argument("--reuse", action="store_true", help="test the samples already beside --out again, drawing none")
    ap.add_argument("--engine", choices=["plain", "spec"], help=argparse.SUPPRESS)  # the child's part
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.positions = sorted({int(p) for p in args.positions.split(",")})
    if args.engine:
        args.child_out.write_text(json.dumps(draw(args)))
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    drawn = {}
    for engine in ("plain", "spec"):
        child_out = args.out.with_suffix(f".{engine}.json")
        if args.reuse:
            if not child_out.is_file():
                print(f"[spec-exactness] --reuse: {child_out} is missing; run without --reuse on a GPU first",
                      file=sys.stderr)
                return 2
            drawn[engine] = json.loads(child_out.read_text())
            continue
        cmd = [sys.executable, "-m", "tools.spec_exactness", "--engine", engine, "--child-out", str(child_out),
               "--model", args.model, "--samples", str(args.samples), "--prompts", str(args.prompts),
               "--positions", ",".join(map(str, args.positions)), "--spec", args.spec,
               *(["--spec-compilation", args.spec_compilation] if args.spec_compilation else [])]
        print(f"[spec-exactness] {engine}: {args.samples} samples x {args.prompts} prompts", flush=True)
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            print(f"[spec-exactness] the {engine} engine failed", file=sys.stderr)
            return 1
        drawn[engine] = json.loads(child_out.read_text())
    if set(drawn["plain"]["samples"]) != set(drawn["spec"]["samples"]):
        print("[spec-exactness] the plain and speculative samples are of different prompts: draw both again",
              file=sys.stderr)
        return 2
    result = compare(drawn["plain"]["samples"], drawn["spec"]["samples"], args.positions, args.alpha, args.bias,
                     args.min_shift)
    counters = drawn["spec"]["counters"]
    drafted, accepted = counters["drafted"], counters["accepted"]
    sizes = sorted({len(v) for v in drawn["spec"]["samples"].values()})
    result.update(spec=drawn["spec"].get("spec"), compilation={e: drawn[e].get("compilation") for e in drawn},
                  samples=sizes[0] if len(sizes) == 1 else sizes,
                  prompts=len(drawn["spec"]["samples"]), positions=args.positions,
                  alpha=args.alpha, bias=args.bias, min_shift=args.min_shift, counters=counters, drafted=drafted, accepted=accepted,
                  exercised=drafted > 0 and accepted > 0 if drawn["spec"].get("spec") else None)
    args.out.write_text(json.dumps(result, indent=1))
    worst = min(result["tests"], key=lambda t: t["p"])
    print(f"[spec-exactness] exact: {result['exact']} (smallest p {worst['p']:.3g} at position {worst['position']}, "
          f"level per test {result['level_per_test']:.3g}); planted bias {args.bias} rejected at each of its "
          f"{result['planted_tests']} tests shifting >= {args.min_shift}: {result['planted_rejected']}; drafted {drafted}, accepted {accepted}; {args.out}", flush=True)
    return 0 if result["exact"] and result["planted_rejected"] and result["exercised"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
