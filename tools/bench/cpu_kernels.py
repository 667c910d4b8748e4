"""CPU regression benchmark of the loss kernels (a script, not a timed test): for future comparisons.

    python -m tools.bench.cpu_kernels [--out outputs/bench/cpu_kernels.json] [--tokens 1024]
        [--vocab 8192] [--k 16] [--repeats 5]

Runs the kernels phase's standalone rows (logits -> loss -> grad: every real path and its plain
reference, see kernels.py) on the CPU in fp32 and writes {"config", "machine", "written_at", "rows"}.
Compare ratios (real / reference) between commits on the same machine, not absolute seconds.
"""

import argparse
import dataclasses
import datetime
import json
import os
from pathlib import Path

from tools.bench import results
from tools.bench.kernels import ALL, standalone
from tools.bench.sizes import SIZES


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/cpu_kernels.json"))
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per micro-batch (one micro-batch)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=ALL)
    args = parser.parse_args(argv)
    import opd_patches

    opd_patches.register()  # the wrappers the real paths go through

    base = SIZES["cpu"]
    size = dataclasses.replace(
        base, name="cpu_kernels", model={**base.model, "vocab_size": args.vocab}, n_seqs=1, seq_len=args.tokens,
        micro_seqs=1, topk=args.k, repeats=args.repeats,
    )
    notes = []
    rows = standalone(size, args.variants, notes)
    doc = {
        "config": {"tokens": args.tokens, "vocab": args.vocab, "k": args.k, "repeats": args.repeats, "dtype": "float32"},
        "machine": results.machine(), "rows": rows, "notes": notes,
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, args.out)
    print(results.table("cpu_kernels", {"size": size.name, "rows": rows, "notes": notes}))
    print(f"[bench] wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
