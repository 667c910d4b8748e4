"""The `suffix` proposer's host memory: arctic-inference's SuffixDecodingCache fed responses as a rollout feeds it.

    python -m tools.bench.suffix_cache [--responses 50 100 200] [--tokens 7168] [--depth 24] [--vocab 151665]
        [--text random|loop] [--out suffix_cache.json]

vLLM's suffix proposer keeps one SuffixDecodingCache per engine (max_tree_depth =
`suffix_decoding_max_tree_depth`, vLLM's default 24), holding every finished response in one global tree
until `suffix_decoding_max_cached_requests` of them are cached (default 10,000, then oldest first). This feeds
it N responses of `--tokens` tokens each, each after a 64-token prompt, as the proposer does (start, the
response, stop), and reads the process's resident memory (VmRSS) before and after: the tree's bytes per cached
token. `random` text draws tokens uniformly (every suffix new: the tree's largest); `loop` repeats one short
random cycle per response (a response stuck in a repetition loop). Needs arctic-inference (docs/speculation.md
says how to install it); runs on a CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
from pathlib import Path


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def response(rng: random.Random, text: str, tokens: int, vocab: int) -> list[int]:
    if text == "random":
        return [rng.randrange(vocab) for _ in range(tokens)]
    cycle = [rng.randrange(vocab) for _ in range(rng.randint(8, 64))]
    return (cycle * (tokens // len(cycle) + 1))[:tokens]


def measure(responses: int, tokens: int, depth: int, vocab: int, text: str, seed: int = 0) -> dict:
    import numpy as np
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    rng = random.Random(seed)
    before = rss_bytes()
    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10_000)
    for i in range(responses):
        cache.start_request(i, np.array([rng.randrange(vocab) for _ in range(64)], dtype=np.int32))
        cache.add_active_response(i, np.array(response(rng, text, tokens, vocab), dtype=np.int32))
        cache.stop_request(i)
    grown = rss_bytes() - before
    assert len(cache.cached_requests) == responses
    return {"responses": responses, "tokens": tokens, "depth": depth, "text": text, "rss_growth_bytes": grown,
            "bytes_per_token": grown / (responses * tokens)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.suffix_cache", description=__doc__.splitlines()[0])
    ap.add_argument("--responses", type=int, nargs="+", default=[50, 100, 200])
    ap.add_argument("--tokens", type=int, default=7168)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=151665, help="R1-Distill-Qwen's tokenizer size")
    ap.add_argument("--text", choices=["random", "loop"], nargs="+", default=["random", "loop"])
    ap.add_argument("--out", type=Path, default=Path("suffix_cache.json"))
    args = ap.parse_args(argv)
    try:
        import arctic_inference  # noqa: F401
    except ImportError:
        print("[suffix-cache] needs arctic-inference (docs/speculation.md: Installing suffix)", file=sys.stderr)
        return 2
    rows, spawn = [], multiprocessing.get_context("spawn")
    for text in args.text:
        for n in args.responses:  # each size in a fresh process: freed trees would blur the next reading
            with spawn.Pool(1) as pool:
                r = pool.apply(measure, (n, args.tokens, args.depth, args.vocab, text))
            rows.append(r)
            print(f"[suffix-cache] {text:6} {n:5d} responses x {args.tokens} tokens: +{r['rss_growth_bytes'] / 2**20:8.1f} MiB, "
                  f"{r['bytes_per_token']:.0f} B per token", flush=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
