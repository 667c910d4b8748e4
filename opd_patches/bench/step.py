"""Bench phase `step`: full training steps of a recipe at the R1-Distill-1.5B architecture.

    python -m opd_patches.bench.step --recipe topk [--steps 2] [--rollout vllm|hf] [--json bench.json]

Builds random-weight R1-Distill-Qwen-1.5B-architecture student (seed 0) and teacher (seed 1) with
opd_patches/embedded/r1_arch.py, runs `run.sh recipe=R` on the embedded prompts (the colocated
teacher by default; extra Hydra overrides after `--`), and reports per step VERL's `timing_s/*`
phases, response lengths and the actor's peak memory (from `<run>/metrics.jsonl`), the device's peak
memory over the whole run (nvidia-smi, sampled every 0.5 s: vLLM's KV cache included), and start-up
time (launch to the end of step 1, minus step 1). With `--rollout hf` responses are capped at 512
tokens (HF decoding is ~25x slower than vLLM). Results merge into the bench JSON under
`step/<recipe>` (rewritten atomically, other phases kept).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASE_KEYS = ("gen", "teacher", "old_log_prob", "update_actor", "update_weights", "save_checkpoint", "step")


class DevicePeak(threading.Thread):
    """Peak `memory.used` (MiB) per GPU seen by nvidia-smi while running; empty without nvidia-smi."""

    def __init__(self, period: float = 0.5):
        super().__init__(daemon=True)
        self.period, self.peak, self._halt = period, {}, threading.Event()

    def run(self):
        while not self._halt.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10,
                ).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.strip().splitlines():
                idx, used = (int(x) for x in line.split(","))
                self.peak[idx] = max(self.peak.get(idx, 0), used)
            self._halt.wait(self.period)

    def stop(self) -> dict:
        self._halt.set()
        self.join(timeout=5)
        return {f"gpu{i}_peak_gib": round(v / 1024, 2) for i, v in sorted(self.peak.items())}


def merge_json(path: Path, key: str, value) -> None:
    """Set data[phase][name] = value in the bench JSON, keeping everything else (atomic rewrite)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    phase, name = key.split("/", 1)
    data.setdefault(phase, {})[name] = value
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def step_rows(metrics_file: Path) -> list[dict]:
    rows = []
    for line in metrics_file.read_text().splitlines() if metrics_file.exists() else []:
        entry = json.loads(line)
        data = entry.get("data", entry)
        if "timing_s/step" not in data:
            continue
        row = {"step": entry.get("step", data.get("training/global_step"))}
        row.update({f"timing_s/{k}": round(data[f"timing_s/{k}"], 2) for k in PHASE_KEYS if f"timing_s/{k}" in data})
        for k in ("response_length/mean", "response_length/max", "response_length/clip_ratio",
                  "actor/perf/max_memory_allocated_gb", "actor/perf/max_memory_reserved_gb", "perf/throughput"):
            if k in data:
                row[k] = round(float(data[k]), 3)
        rows.append(row)
    return rows


def run(recipe: str, steps: int, rollout: str, workdir: Path, overrides: list[str], timeout: int,
        arch: str = "r1") -> dict:
    from opd_patches.embedded import build as embedded
    from opd_patches.embedded import r1_arch

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.monotonic()
    data = embedded.build(REPO / ".cache" / "embedded")
    if arch == "r1":
        student, teacher = r1_arch.build(workdir / "r1_arch", seeds=(0, 1), device=device)
    else:  # the tiny embedded models: a quick check of this script on a CPU
        student, teacher = data["student"], data["teacher"]
    build_s = time.monotonic() - start
    run_dir = workdir / f"run_{recipe}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    env = {
        **os.environ, "STUDENT": str(student), "TEACHER": str(teacher), "TRAIN_FILES": str(data["train"]),
        "VAL_FILES": str(data["val"]), "OUTPUT_DIR": str(run_dir), "PYTHON": sys.executable,
        "DEVICE": "gpu" if rollout == "vllm" else ("gpu-hf" if device == "cuda" else "cpu"),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [str(REPO / "run.sh"), f"recipe={recipe}", f"trainer.total_training_steps={steps}",
           "trainer.resume_mode=disable", "opd.preflight=cheap"]
    if rollout == "hf":
        cmd.append("data.max_response_length=512")
    cmd += overrides
    print(f"[bench step] {recipe}: {' '.join(cmd)}  (log: {run_dir / 'run.log'})", flush=True)
    peak = DevicePeak()
    peak.start()
    launched = time.monotonic()
    first_step_at = None
    with open(run_dir / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        while proc.poll() is None:
            if time.monotonic() - launched > timeout:
                proc.kill()
                break
            if first_step_at is None and step_rows(run_dir / "metrics.jsonl"):
                first_step_at = time.monotonic()
            time.sleep(1.0)
    wall = time.monotonic() - launched
    rows = step_rows(run_dir / "metrics.jsonl")
    result = {
        "recipe": recipe, "rollout": rollout, "arch": arch, "steps_requested": steps, "steps_done": len(rows),
        "returncode": proc.returncode, "wall_s": round(wall, 1), "model_build_s": round(build_s, 1),
        "steps": rows, **peak.stop(),
        "overrides": cmd[2:],
    }
    if first_step_at is not None and rows:
        result["startup_s"] = round(first_step_at - launched - rows[0].get("timing_s/step", 0.0), 1)
    return result


def print_table(result: dict) -> None:
    print(f"\n[bench step] {result['recipe']} ({result['rollout']} rollout): {result['steps_done']}/"
          f"{result['steps_requested']} steps, exit {result['returncode']}, start-up {result.get('startup_s')} s, "
          f"device peak {', '.join(f'{k}={v}' for k, v in result.items() if k.endswith('_peak_gib'))}")
    cols = [f"timing_s/{k}" for k in PHASE_KEYS] + ["response_length/mean", "response_length/max",
                                                    "actor/perf/max_memory_allocated_gb"]
    print("step " + " ".join(c.split("/")[-1][:14].rjust(14) for c in cols))
    for row in result["steps"]:
        print(f"{row['step']!s:>4} " + " ".join(str(row.get(c, "-")).rjust(14) for c in cols))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="topk")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rollout", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench")
    p.add_argument("--json", type=Path, default=REPO / "bench.json")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--arch", choices=("r1", "embedded"), default="r1", help="embedded: tiny models (CPU check)")
    args = p.parse_args(argv)
    result = run(args.recipe, args.steps, args.rollout, args.workdir, extra, args.timeout, args.arch)
    merge_json(args.json, f"step/{args.recipe}", result)
    print_table(result)
    return 0 if result["steps_done"] == args.steps and result["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
