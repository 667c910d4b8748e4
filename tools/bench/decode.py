"""Bench phase `decode`: what a batch costs to generate, and whether training can share the GPU with decode.

    python -m tools.bench.decode [--batches 32 64 128] [--tokens 7168]
        [--train-shares 100 50 25] [--share-tokens 2048] [--share-batches 32 16 8] [--out bench.json]
    (make bench PHASE=decode; the shares need the MPS daemon: see below)

vLLM alone (the recipes' engine settings: `gpu_memory_utilization` 0.5, their compilation and CUDA
graphs) decodes the random R1-Distill-1.5B-architecture model (opd_patches/embedded/r1_arch.py)
for B prompts x `--tokens` forced tokens (`min_tokens` = `max_tokens`, EOS ignored), once per batch
size: decode at this size is latency-bound, so the time per step grows far less than the batch.

`--train-shares P ...` asks whether the update could run under generation (docs/performance.md): for each P a
child process runs a training forward+backward loop of the same model (2 x 5,200 tokens, gradient
checkpointing, no optimizer step) with `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=P` while this process
decodes B x `--share-tokens` for each B of `--share-batches` (default 32; fewer: generation's tail); both
rates are compared with each alone. The limit is honoured only
under the MPS control daemon, started before this command (root): `nvidia-cuda-mps-control -d`, and
`echo quit | nvidia-cuda-mps-control` after. Without the daemon the child is time-sliced with vLLM.
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

REPO = Path(__file__).resolve().parents[2]
TRAIN_SEQS, TRAIN_LEN = 2, 5200  # one update micro-batch pair at the seed's mean response length


def engine(model: Path, max_len: int):
    from vllm import LLM

    return LLM(model=str(model), dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=max_len,
               compilation_config=dict(ROLLOUT_COMPILATION), seed=0)


def decode(llm, batch: int, tokens: int) -> dict:
    """B prompts of 64 tokens x `tokens` forced new tokens -> seconds and ms per decode step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=1.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=[(1000 + 7 * i + j) % 150000 for j in range(64)]) for i in range(batch)]
    start = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.monotonic() - start
    made = [len(o.outputs[0].token_ids) for o in outs]
    if min(made) != tokens:
        raise RuntimeError(f"decode: asked for {tokens} tokens per sequence, got {min(made)}..{max(made)}")
    return {"batch": batch, "tokens": tokens, "seconds": round(seconds, 3), "ms_per_step": round(1e3 * seconds / tokens, 3)}


def train_loop(model: Path) -> None:
    """Child: fwd+bwd iterations until SIGTERM; prints "ready", then each iteration's end time (time.time()).

    It ends by returning, never by a kill: a SIGKILLed MPS client left the MPS server refusing new
    clients (error 807) and vLLM's engine with an illegal memory access (docs/performance.md)."""
    import signal

    import torch
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    net.gradient_checkpointing_enable()
    net.train()
    ids = torch.randint(0, 150000, (TRAIN_SEQS, TRAIN_LEN), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print("ready", flush=True)
    while not stop:
        net(input_ids=ids, labels=ids).loss.backward()
        net.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        print(f"{time.time():.4f}", flush=True)


def train_rate(ends: list[float], window: tuple[float, float] | None = None) -> float | None:
    """Seconds per iteration over the iterations that ended inside `window` (start, end), or over the whole
    list after its first (a warm-up); None with fewer than two."""
    ends = [t for t in ends if window[0] <= t <= window[1]] if window is not None else ends[1:]
    return (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) >= 2 else None


class Trainer:
    """The training child under `share` % of the SMs (None: no limit), its iteration end times collected."""

    def __init__(self, model: Path, share: int | None):
        import threading

        env = {**os.environ}
        if share is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(share)
        self.proc = subprocess.Popen([sys.executable, "-m", "tools.bench.decode", "train", "--model", str(model)],
                                     env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the training child exited {self.proc.wait()} before it was ready")
        self.ends: list[float] = []
        self._reader = threading.Thread(target=lambda: self.ends.extend(float(x) for x in self.proc.stdout), daemon=True)
        self._reader.start()

    def stop(self) -> list[float]:
        self.proc.terminate()  # the child finishes its iteration and exits (see train_loop)
        self.proc.wait(timeout=120)
        self._reader.join(timeout=5)
        return list(self.ends)


def shared(llm, model: Path, share: int | None, tokens: int, batch: int = 32) -> dict:
    """Decode `batch` x `tokens` while the training child runs under `share` % of the SMs."""
    child = Trainer(model, share)
    time.sleep(5.0)  # a few iterations first: the child runs steadily when decode starts
    t0 = time.time()
    res = decode(llm, batch, tokens)
    t1 = time.time()
    ends = child.stop()
    return {"share": share, "decode": res, "train_s_per_iter": train_rate(ends, (t0, t1)),
            "train_iters_during_decode": len([t for t in ends if t0 <= t <= t1])}


def run_phase(size, args) -> dict:
    from opd_patches.embedded import r1_arch

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process initialises CUDA first
    workdir = Path(args.workdir)
    model = r1_arch.build(workdir / "r1_arch", seeds=(0,), device="cuda")[0]
    tokens = max(args.tokens, args.share_tokens)
    llm = engine(model, 64 + tokens + 16)
    decode(llm, 8, 64)  # warm-up: the first generate captures nothing new but pays one-time costs
    rows, batches = [], []
    for b in args.batches:
        r = decode(llm, b, args.tokens)
        batches.append(r)
        print(f"[bench decode] {b} x {args.tokens}: {r['seconds']} s ({r['ms_per_step']} ms/step)", flush=True)
        rows.append({"name": f"decode/{b}x{args.tokens}", "time_s": r["seconds"], "ref_time_s": None, "ratio": None,
                     "tok_per_s": b * args.tokens / r["seconds"], "peak_gib": None, **r})
    sharing = []
    if args.out is not None:  # the batch table is kept even if the sharing runs fail or time out
        from tools.bench import results

        results.merge(args.out, "decode", {"size": "full", "rows": list(rows), "batches": batches, "sharing": []})
    if args.train_shares:
        # --share-batches: generation's tail decodes fewer sequences (the others have ended): is decode there
        # slowed less by the training beside it than at the full batch?
        share_batches = getattr(args, "share_batches", None) or [32]
        alone = {b: decode(llm, b, args.share_tokens) for b in share_batches}
        alone_decode = alone[share_batches[0]]
        solo = Trainer(model, None)  # alone: vLLM holds its memory but decodes nothing meanwhile
        time.sleep(15.0)
        alone_train = train_rate(solo.stop())
        for batch, share in [(b, p) for b in share_batches for p in args.train_shares]:
            s = shared(llm, model, share, args.share_tokens, batch)
            s["decode_slowdown"] = round(s["decode"]["ms_per_step"] / alone[batch]["ms_per_step"], 3)
            if s["train_s_per_iter"] and alone_train:
                s["train_slowdown"] = round(s["train_s_per_iter"] / alone_train, 3)
                # work done together per unit time, relative to doing the two one after the other
                s["combined_rate"] = round(1 / s["decode_slowdown"] + 1 / s["train_slowdown"], 3)
            sharing.append(s)
            print(f"[bench decode] train share {share} %: {json.dumps(s)}", flush=True)
            rows.append({"name": f"decode/shared/{share}" + (f"/b{batch}" if batch != 32 else ""),
                         "time_s": s["decode"]["seconds"], "ref_time_s": alone[batch]["seconds"], "ratio": s["decode_slowdown"], "tok_per_s": None,
                         "peak_gib": None, **{k: v for k, v in s.items() if k != "decode"}})
        sharing = {"decode_alone": alone_decode, "decode_alone_by_batch": list(alone.values()),
                   "train_alone_s_per_iter": alone_train, "runs": sharing,
                   "mps_daemon": _mps_running()}
    return {"size": "full", "rows": rows, "batches": batches, "sharing": sharing,
            "notes": ["decode rows: B prompts x forced tokens, vLLM alone; shared rows: ratio = decode ms/step with "
                      "the training child running / alone; combined_rate > 1 means sharing beats running in turn"]}


def _mps_running() -> bool:
    try:
        return subprocess.run(["pgrep", "-f", "nvidia-cuda-mps-control"], capture_output=True).returncode == 0
    except OSError:
        return False


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        p = argparse.ArgumentParser(prog="decode train")
        p.add_argument("--model", type=Path, required=True)
        train_loop(p.parse_args(argv[1:]).model)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--tokens", type=int, default=7168)
    p.add_argument("--train-shares", type=int, nargs="*", default=[])
    p.add_argument("--share-tokens", type=int, default=2048)
    p.add_argument("--share-batches", type=int, nargs="+", default=[32])
    p.add_argument("--workdir", type=Path, default=Path(".cache/bench"))
    p.add_argument("--out", type=Path, default=Path("bench.json"))
    a = p.parse_args(argv)
    from tools.bench import results

    entry = run_phase(None, a)
    results.report(a.out, "decode", entry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
