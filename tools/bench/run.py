"""CLI of `make bench`: run one phase at one size, merge it into the JSON, print the table.

    python -m tools.bench --phase kernels|teacher|step|layout|save|decode|lastsave [--size full|cpu] [--out bench.json]
        [--variants k1_pg lean_topk_tail ...] [--no-model]          (kernels)
        [--seq-len N] [--micro-seqs M]          (any phase that uses the size's sequences)
        [--recipe topk [k1 ...]] [--gpus 0 1] [--rollout vllm|hf] [--steps 2] [--override K=V ...]
        [--lengths seed-math500 | cap@2,seed-math500@2]   (step)
        [--batches 32 64 128] [--tokens 7168] [--train-shares 100 25 ...] [--share-tokens 2048] [--share-batches 32 8]   (decode)
        [--workdir DIR] [--rounds 4]   (save, lastsave)
"""

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

from tools.bench import results
from tools.bench.sizes import SIZES

# phase -> "module:function"; a phase takes (Size, argparse.Namespace) and returns {"rows": [...], ...}.
PHASES = {
    "kernels": "tools.bench.kernels:run_phase",
    "teacher": "tools.bench.teacher:run_phase",
    "step": "tools.bench.step:run_phase",
    "layout": "tools.bench.layout:run_phase",
    "save": "tools.bench.save:run_phase",
    "decode": "tools.bench.decode:run_phase",
    "lastsave": "tools.bench.last_save:run_phase",
}


def phase_fn(name):
    if name not in PHASES:
        raise SystemExit(f"[bench] unknown or not yet registered phase {name!r}: choose one of {sorted(PHASES)} "
                         "(tools/bench/run.py PHASES)")
    module, fn = PHASES[name].split(":")
    return getattr(importlib.import_module(module), fn)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: full with CUDA, else cpu")
    parser.add_argument("--out", type=Path, default=Path("bench.json"))
    parser.add_argument("--variants", nargs="+", help="kernels phase: a subset of the loss paths")
    parser.add_argument("--no-model", action="store_true", help="kernels phase: standalone loss rows only")
    parser.add_argument("--seq-len", type=int, help="override the size's tokens per sequence (e.g. a step run's "
                        "mean response length, for the floor at those lengths)")
    parser.add_argument("--micro-seqs", type=int, help="override the size's sequences per update micro-batch")
    step = parser.add_argument_group("step phase (full training steps through run.sh)")
    step.add_argument("--recipe", nargs="+", default=["topk"], help="one or more recipes")
    step.add_argument("--gpus", nargs="+", help="one GPU index per recipe: run the recipes at the same time")
    step.add_argument("--rollout", choices=("vllm", "hf"), default="vllm")
    step.add_argument("--steps", type=int, default=3)
    step.add_argument("--save-after", type=int, default=1, help="save after this step only (0: no save)")
    step.add_argument("--override", nargs="*", help="extra Hydra overrides for run.sh")
    step.add_argument("--lengths", help="response lengths: a profile (seed-math500, lognormal:MEDIAN:SIGMA, cap) or a "
                      "schedule cap@2,seed-math500@2 (opd_patches/hooks/lengths.py); default: every response to the cap")
    step.add_argument("--workdir", type=Path, default=Path(".cache/bench"), help="models and run folders")
    step.add_argument("--timeout", type=int, default=3600, help="seconds before the run is killed")
    parser.add_argument("--rounds", type=int, default=4, help="lastsave phase: saves after the first one")
    dec = parser.add_argument_group("decode phase (vLLM decode per batch size; training beside it under MPS)")
    dec.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128])
    dec.add_argument("--tokens", type=int, default=7168, help="forced new tokens per sequence")
    dec.add_argument("--train-shares", type=int, nargs="*", default=[], help="MPS active-thread %% of the training child")
    dec.add_argument("--share-tokens", type=int, default=2048, help="new tokens of the decode beside the training")
    dec.add_argument("--share-batches", type=int, nargs="+", default=[32],
                     help="sequences decoded beside the training (fewer: generation's tail)")
    args = parser.parse_args(argv)
    import torch

    size_name = args.size or ("full" if torch.cuda.is_available() else "cpu")
    size = SIZES[size_name]
    if args.seq_len or args.micro_seqs:
        size = dataclasses.replace(size, seq_len=args.seq_len or size.seq_len,
                                   micro_seqs=args.micro_seqs or size.micro_seqs)
    if size.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"[bench] size {size_name} needs a CUDA GPU; use --size cpu (SIZE=cpu) here.")
    fn = phase_fn(args.phase)
    import opd_patches

    opd_patches.register()  # the registered losses and the wrappers the real paths go through

    entry = fn(size, args)
    results.report(args.out, args.phase, entry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
