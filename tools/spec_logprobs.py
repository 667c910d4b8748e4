"""What speculation does to the log-probs the rollout returns: vLLM's against the model's own, with and without it.

    python -m tools.spec_logprobs [--out outputs/spec_exactness.json] [--model .cache/addition/student]
        [--device cpu|cuda] [--batch 512]

Reads the two sample sets that tools/spec_exactness.py keeps beside its --out (`<out>.plain.json`,
`<out>.spec.json`; each holds vLLM's log-prob of every sampled token, asked for as the training rollout asks).
For every sampled token, the reference is the model's own log-prob of it given the prompt and the tokens before,
from one teacher-forced transformers forward in float32 (`sampled_logprobs`, the project's exact log-softmax). The
difference vLLM minus reference is summarised per engine, at the first position (drawn from the prompt's pass,
never drafted) and at the later ones (where the speculative engine returns accepted drafts' log-probs from the
verification pass): tokens, mean, mean absolute, 99th percentile and largest absolute difference. The plain
engine's row is the floor that vLLM's kernels and dtype set without speculation; the speculative engine's row
beside it shows what speculation adds. Writes `<out stem>.logprobs.json`; runs on a CPU (the kept files move).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def reference(model, prompt_ids: list[int], samples: list[list[int]], batch: int) -> list[list[float]]:
    """The model's float32 log-prob of each token of each sample after `prompt_ids` (samples of any length)."""
    import torch

    from opd_patches.losses.sampled_logprob import sampled_logprobs

    device = next(model.parameters()).device
    out = []
    for lo in range(0, len(samples), batch):
        chunk = samples[lo:lo + batch]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), len(prompt_ids) + width, dtype=torch.long)
        for i, s in enumerate(chunk):
            ids[i, :len(prompt_ids) + len(s)] = torch.tensor(prompt_ids + s)
        with torch.no_grad():  # right padding: a causal model's rows before the pad never see it
            logits = model(input_ids=ids.to(device)).logits.float()
        rows = logits[:, len(prompt_ids) - 1:-1]  # row t predicts token t + 1
        lp = sampled_logprobs(rows, ids[:, len(prompt_ids):].to(device)).cpu()
        out.extend(lp[i, :len(s)].tolist() for i, s in enumerate(chunk))
    return out


def summary(diffs: list[float]) -> dict:
    if not diffs:
        return {"tokens": 0}
    size = sorted(abs(d) for d in diffs)
    return {"tokens": len(diffs), "mean": sum(diffs) / len(diffs), "mean_abs": sum(size) / len(size),
            "p99_abs": size[min(len(size) - 1, int(0.99 * len(size)))], "max_abs": size[-1]}


def differences(drawn: dict, model, batch: int) -> dict:
    """{"first": summary, "later": summary} of vLLM's log-prob minus the reference over one engine's samples."""
    first, later = [], []
    for prompt, samples in drawn["samples"].items():
        ref = reference(model, drawn["prompt_ids"][prompt], samples, batch)
        for got, want in zip(drawn["logprobs"][prompt], ref):
            diffs = [g - w for g, w in zip(got, want)]
            first.extend(diffs[:1])
            later.extend(diffs[1:])
    return {"first": summary(first), "later": summary(later)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.spec_logprobs", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "spec_exactness.json",
                    help="tools/spec_exactness.py's --out: its kept samples lie beside it")
    ap.add_argument("--model", default=str(REPO / ".cache" / "addition" / "student"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=512)
    args = ap.parse_args(argv)
    drawn = {}
    for engine in ("plain", "spec"):
        path = args.out.with_suffix(f".{engine}.json")
        if not path.is_file():
            print(f"[spec-logprobs] {path} is missing: run python -m tools.spec_exactness --out {args.out} on a GPU "
                  "first", file=sys.stderr)
            return 2
        drawn[engine] = json.loads(path.read_text())
        if "logprobs" not in drawn[engine]:
            print(f"[spec-logprobs] {path} holds no log-probs (drawn by an older tools.spec_exactness): draw again",
                  file=sys.stderr)
            return 2
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).to(args.device).eval()
    result = {"model": args.model, "spec": drawn["spec"].get("spec"),
              "compilation": {e: drawn[e].get("compilation") for e in drawn},
              **{engine: differences(drawn[engine], model, args.batch) for engine in drawn}}
    path = args.out.with_suffix(".logprobs.json")
    path.write_text(json.dumps(result, indent=1))
    print("[spec-logprobs] vLLM's log-prob minus the model's float32 one, per sampled token:")
    print(f"  {'engine':6} {'positions':9} {'tokens':>8} {'mean':>10} {'mean |d|':>10} {'p99 |d|':>10} {'max |d|':>10}")
    for engine in drawn:
        for part in ("first", "later"):
            s = result[engine][part]
            if s["tokens"]:
                print(f"  {engine:6} {part:9} {s['tokens']:8d} {s['mean']:10.2e} {s['mean_abs']:10.2e} "
                      f"{s['p99_abs']:10.2e} {s['max_abs']:10.2e}")
    print(f"[spec-logprobs] {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
