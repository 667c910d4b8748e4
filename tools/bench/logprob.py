"""Microbench of the sampled-token log-prob, fwd+bwd: upstream's fallback vs the patched kernel vs naive.

    python -m tools.bench.logprob [--tokens 15600] [--vocab 151936] [--dtype bfloat16]
        [--repeats 3] [--no-autocast] [--variants upstream_v2 patched naive] [--out FILE.json]

GPU defaults: one actor micro-batch of the 1.5B recipes (15,600 tokens x 151,936 vocabulary, bf16
logits), under torch.autocast(bf16) as VERL's FSDP engine runs its forward; about a minute of GPU
time. Without CUDA it runs a reduced size (2,048 x 32,000, no autocast) to show it works.
Rows (each: logits leaf -> log-probs -> (log-probs * w).sum() -> backward, median of --repeats after
one warm-up; peak = torch.cuda.max_memory_allocated over the timed runs, including the resident
(T, V) logits leaf and its gradient):
- upstream_v2: verl.utils.torch_functional.logprobs_from_logits_v2, the unpatched original (what
  logprobs_from_logits runs without flash-attn);
- patched: opd_patches.losses.sampled_logprob.sampled_logprobs (what the patch runs instead);
- naive: verl's logprobs_from_logits_naive (one batched log_softmax + gather: the speed floor, at
  the cost of a (T, V) fp32 tensor under autocast);
- flash_ce: flash-attn's Triton cross-entropy through logprobs_from_logits, when flash-attn is installed.
Each row also reports max |log-prob - fp32 reference| over the tokens.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from tools.bench.measure import measure

VARIANTS = ("upstream_v2", "patched", "naive", "flash_ce")


def variant_fn(name):
    import verl.utils.torch_functional as verl_F

    from opd_patches.losses.sampled_logprob import sampled_logprobs

    v2 = verl_F.logprobs_from_logits_v2
    fns = {
        "upstream_v2": getattr(v2, "__wrapped__", v2),  # the original even where the patch is applied
        "patched": sampled_logprobs,
        "naive": verl_F.logprobs_from_logits_naive,
        "flash_ce": verl_F.logprobs_from_logits if verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE else None,
    }
    return fns[name]


def bench(tokens, vocab, dtype, device, repeats, use_autocast, variants):
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(tokens, vocab, generator=gen, device=device) * 2).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    weights = torch.randn(tokens, generator=gen, device=device)
    with torch.no_grad():  # fp32 reference values, chunked so the reference itself stays small
        ref = torch.cat([torch.log_softmax(logits[a:a + 1024].float(), -1).gather(-1, labels[a:a + 1024, None])[:, 0]
                         for a in range(0, tokens, 1024)])
    cast = torch.autocast(device.type, dtype=torch.bfloat16) if use_autocast else contextlib.nullcontext()
    rows = []
    for name in variants:
        fn = variant_fn(name)
        if fn is None:
            print(f"[logprob] {name}: skipped (flash-attn not installed)", flush=True)
            continue
        errors = []

        def step():
            with cast:
                lp = fn(logits, labels)
            (lp.float() * weights).sum().backward()
            errors.append((lp.detach().float() - ref).abs().max().item())
            logits.grad = None

        result = measure(step, device, repeats)
        peak = result["peak_gib"]
        rows.append({"name": name, "tokens": tokens, "vocab": vocab, "time_s": result["time_s"],
                     "tok_per_s": tokens / result["time_s"], "peak_gib": peak,
                     "extra_gib": None if peak is None else peak - result["resident_gib"],
                     "max_abs_err": max(errors)})
        print(f"[logprob] {name}: {result['time_s']:.4f} s, peak {_gib(peak)} GiB", flush=True)
    return rows


def _gib(x):
    return "n/a" if x is None else f"{x:.2f}"


def table(rows, header):
    base = next((r["time_s"] for r in rows if r["name"] == "naive"), None)
    lines = [header, f"{'variant':<12} {'time_s':>9} {'vs_naive':>8} {'tok/s':>11} {'peak_GiB':>9} "
             f"{'extra_GiB':>9} {'max_abs_err':>11}"]
    for r in rows:
        ratio = f"{r['time_s'] / base:8.2f}" if base else f"{'n/a':>8}"
        lines.append(f"{r['name']:<12} {r['time_s']:9.4f} {ratio} {r['tok_per_s']:11.0f} {_gib(r['peak_gib']):>9} "
                     f"{_gib(r['extra_gib']):>9} {r['max_abs_err']:11.2e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=15_600 if cuda else 2_048)
    parser.add_argument("--vocab", type=int, default=151_936 if cuda else 32_000)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-autocast", action="store_true", help="GPU: run outside torch.autocast(bf16)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    from tools.bench.results import machine

    device = torch.device("cuda" if cuda else "cpu")
    use_autocast = cuda and not args.no_autocast and args.dtype == "bfloat16"
    rows = bench(args.tokens, args.vocab, getattr(torch, args.dtype), device, args.repeats, use_autocast,
                 args.variants)
    info = machine()
    header = (f"== sampled-token log-prob fwd+bwd: {args.tokens} x {args.vocab} {args.dtype}, "
              f"autocast {'on' if use_autocast else 'off'}, {info.get('gpu', 'CPU')} ==")
    print(table(rows, header))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"config": {**vars(args), "out": str(args.out), "autocast": use_autocast}, "machine": info, "rows": rows}
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
