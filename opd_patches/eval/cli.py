"""Command line of `python -m opd_patches.eval` (what `make eval` runs); see `opd_patches.eval.harness`."""

from __future__ import annotations

import argparse
import sys

from opd_patches.eval.suites import DEFAULT_DATA_DIR, suite_names


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m opd_patches.eval", description="Evaluate a model on a math suite.")
    ap.add_argument("--model", required=True, help="HF model folder (e.g. <run>/global_step_N/actor/huggingface) or hub id")
    ap.add_argument("--suite", required=True, help=f"{', '.join(suite_names())}, or a protocol .yaml path")
    ap.add_argument("--out", help="output folder (default: <run>/global_step_N/eval/<suite> for a checkpoint, "
                                  "else outputs/eval/<model name>/<suite>)")
    ap.add_argument("--data-dir", help=f"folder of the suite's JSONL files (default $OPD_EVAL_DATA, else {DEFAULT_DATA_DIR})")
    ap.add_argument("--limit", type=int, help="only the first N questions")
    ap.add_argument("--samples", type=int, help="samples per question (protocol's otherwise)")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--backend", choices=["auto", "hf", "vllm"], default="auto", help="auto: vllm when importable with a GPU, else hf")
    ap.add_argument("--batch-size", type=int, help="prompts per generate call (hf: 32 on CUDA, 8 on CPU; vllm: 1024)")
    ap.add_argument("--gpu-memory-utilization", dest="gpu_memory_utilization", type=float,
                    help="vllm: share of the GPU's memory (default: sized from what is free at the engine's start, "
                         "at most 0.9; $OPD_EVAL_GPU_MEM sets it too)")
    ap.add_argument("--model-hash", dest="model_hash", help="digest of the model's files: an --out folder holding "
                    "samples of the same digest is resumed even where the model's path differs (make select's student cache)")
    ap.add_argument("--step", type=int, help="training step for plots (default: from global_step_N in --model)")
    ap.add_argument("--grade-timeout", dest="grade_timeout_s", type=float, default=10.0, help="math-verify seconds per sample")
    ap.add_argument("--teacher-kl", dest="teacher_kl", help="teacher model folder: also measure the teacher-KL of fresh "
                    "samples on the suite's questions (opd_patches/eval/teacher_kl.py), into summary.json")
    ap.add_argument("--kl-samples", dest="kl_samples", type=int, default=1, help="samples per question for --teacher-kl")
    ap.add_argument("--verifier", help="judge model asked when the rule grader cannot decide (off by default)")
    ap.add_argument("--verifier-max-new-tokens", type=int, default=64)
    ap.add_argument("--verifier-prompt", help="prompt file with {question} {gold} {answer} (default: built in)")
    return ap


def main(argv=None) -> int:
    args = vars(parser().parse_args(argv))
    from opd_patches.eval.harness import run

    from opd_patches.eval.gpu_memory import NotEnoughGPUMemory

    try:
        summary = run(args)
    except (FileNotFoundError, KeyError, ValueError, NotEnoughGPUMemory) as exc:
        print(f"[eval] error: {exc}", file=sys.stderr)
        return 2
    return 0 if summary else 1
