"""Bench phase `step`: full training steps of a recipe at the R1-Distill-1.5B architecture.

    python -m tools.bench --phase step --recipe topk [k1 ...] [--gpus 0 1] [--steps 3]
        [--save-after 1] [--rollout vllm|hf] [--size full|cpu] [--override KEY=VALUE ...]
        (make bench PHASE=step RECIPE=topk; RECIPE="k1 topk" GPUS="0 1": both at once, one GPU each)

Builds random-weight R1-Distill-Qwen-1.5B-architecture student (seed 0) and teacher (seed 1) with
opd_patches/embedded/r1_arch.py, runs `run.sh recipe=R` on the embedded prompts (the colocated teacher by default;
extra Hydra overrides with --override), and reports per step VERL's `timing_s/*` phases, response lengths, a
speculating rollout's drafts and acceptance (`rollout/spec_*`) and the actor's peak memory (from
`<run>/metrics.jsonl`), the device's peak memory over the whole run (nvidia-smi, sampled periodically: vLLM's KV
cache included) with each process's own peak (which of the trainer's processes holds what; the models are drawn in
a child process, so this driver holds none), and start-up time (launch to the end of step 1, minus step 1). One
save, after step `--save-after` (default 1; 0: none) and not at the end, so that the save's stall on training shows
in a step that another follows (`timing_s/save_checkpoint`: what the trainer waited; the state's export, validation
and hashing run in the background) while the host's disk holds one 1.5B state only. With `--rollout hf` responses
are capped at 512 tokens at the full size (HF decoding is far slower than vLLM). `--size cpu` runs the tiny
embedded models with the smoke overlay's lengths instead (a check of this phase on a CPU). Results merge into the
bench JSON's `step` phase, per recipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from opd_patches.eval.gpu_memory import process_name

REPO = Path(__file__).resolve().parents[2]
PHASE_KEYS = ("gen", "teacher", "old_log_prob", "update_actor", "update_weights", "save_checkpoint", "step")


def _smi(query: str, *fields: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-{query}={','.join(fields)}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=10).stdout
    return [[x.strip() for x in line.split(",")] for line in out.strip().splitlines() if line.strip()]


class DevicePeak(threading.Thread):
    """Peak memory seen by nvidia-smi while running: `memory.used` per GPU (every process on the device,
    this one's included) and each compute process's own `used_memory` (which process holds what);
    empty without nvidia-smi."""

    def __init__(self, period: float = 0.5):
        super().__init__(daemon=True)
        self.period, self.peak, self.process_peak, self._halt = period, {}, {}, threading.Event()

    def run(self):
        while not self._halt.is_set():
            try:
                devices = _smi("gpu", "index", "memory.used")
                processes = _smi("compute-apps", "pid", "used_memory")
            except (OSError, subprocess.TimeoutExpired):
                return
            for idx, used in devices:
                self.peak[int(idx)] = max(self.peak.get(int(idx), 0), int(used))
            for pid, used in processes:
                if not used.isdigit():
                    continue
                name, peak = self.process_peak.get(int(pid), (process_name(int(pid)), 0))
                self.process_peak[int(pid)] = (name, max(peak, int(used)))
            self._halt.wait(self.period)

    def stop(self) -> dict:
        self._halt.set()
        self.join(timeout=5)
        out = {f"gpu{i}_peak_gib": round(v / 1024, 2) for i, v in sorted(self.peak.items())}
        out["process_peaks"] = [{"pid": pid, "name": name, "peak_gib": round(peak / 1024, 2)}
                                for pid, (name, peak) in sorted(self.process_peak.items(), key=lambda kv: -kv[1][1])]
        return out


def build_r1_models(out: Path, device: str) -> tuple[Path, Path]:
    """Student (seed 0) and teacher (seed 1) at the R1-Distill-1.5B architecture, drawn in a child process:
    a CUDA draw in this process would keep its context and cached blocks on the GPU for as long as this
    driver lives, beside the training and the evaluation it launches."""
    cmd = [sys.executable, "-m", "opd_patches.embedded.r1_arch", "--out", str(out), "--seeds", "0", "1",
           "--device", device]
    subprocess.run(cmd, check=True, cwd=REPO)
    return out / "seed0", out / "seed1"


def gpu_visible() -> bool:
    """A CUDA device is visible, asked through NVML (no CUDA context in this process)."""
    import torch

    return torch.cuda.device_count() > 0


def step_rows(metrics_file: Path) -> list[dict]:
    rows = []
    for line in metrics_file.read_text().splitlines() if metrics_file.exists() else []:
        entry = json.loads(line)
        data = entry.get("data", entry)
        if "timing_s/step" not in data:
            continue
        row = {"step": entry.get("step", data.get("training/global_step"))}
        row.update({f"timing_s/{k}": round(data[f"timing_s/{k}"], 2) for k in PHASE_KEYS if f"timing_s/{k}" in data})
        for k in ("response_length/mean", "response_length/max", "response_length/min", "response_length/clip_ratio",
                  "actor/perf/max_memory_allocated_gb", "actor/perf/max_memory_reserved_gb", "perf/throughput"):
            if k in data:
                row[k] = round(float(data[k]), 3)
        # with a speculative_config, the step's drafts and acceptance (opd_patches/rollout/spec_metrics.py)
        row.update({k: round(float(v), 4) for k, v in data.items() if k.startswith("rollout/spec_")})
        rows.append(row)
    return rows


def requested_lengths(log: Path) -> dict[int, dict]:
    """Per step, what the length profile asked the rollout for (lengths.py's request log)."""
    by_step: dict[int, list] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        r = json.loads(line)
        by_step.setdefault(int(r["step"]), []).append(r)
    return {step: {"lengths": rs[0]["profile"], "requested_tokens/mean": round(sum(r["tokens"] for r in rs) / len(rs), 1),
                   "requested_tokens/min": min(r["tokens"] for r in rs), "requested_tokens/max": max(r["tokens"] for r in rs),
                   "requests": len(rs)} for step, rs in sorted(by_step.items())}


def run(recipe: str, steps: int, rollout: str, workdir: Path, overrides: list[str], timeout: int,
        arch: str = "r1", gpu: str | None = None, lengths: str | None = None) -> dict:
    """One recipe's run through run.sh; `gpu` (an nvidia-smi index) pins it to that GPU, with a lock
    folder of its own so that runs on other GPUs of the host do not wait for each other. `lengths`: a
    length profile or schedule (lengths.py), enforced per request by a bench-only agent loop."""
    from opd_patches.embedded import build as embedded

    device = "cuda" if gpu_visible() else "cpu"
    start = time.monotonic()
    data = embedded.build(REPO / ".cache" / "embedded")
    if arch == "r1":
        student, teacher = build_r1_models(workdir / "r1_arch", device)
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
    if gpu is not None:
        env.update(CUDA_VISIBLE_DEVICES=str(gpu), OPD_LOCK_DIR=str(workdir / "lock"))
    cmd = [str(REPO / "run.sh"), f"recipe={recipe}", f"trainer.total_training_steps={steps}",
           "trainer.resume_mode=disable", "opd.preflight=cheap"]
    if rollout == "hf" and arch == "r1":  # the tiny embedded models keep the smoke overlay's length
        cmd.append("data.max_response_length=512")
    cmd += overrides
    request_log = run_dir / "requested_lengths.jsonl"
    if lengths:
        from opd_patches.hooks import lengths as profiles

        cmd += profiles.overrides(profiles.write_config(run_dir / "length_profile.yaml", lengths, log=request_log))
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
    asked = requested_lengths(request_log)
    for row in rows:
        row.update(asked.get(int(row["step"]), {}))
    result = {
        "recipe": recipe, "rollout": rollout, "arch": arch, "steps_requested": steps, "steps_done": len(rows),
        "returncode": proc.returncode, "wall_s": round(wall, 1), "model_build_s": round(build_s, 1),
        "steps": rows, **peak.stop(), "gpu": gpu, "lengths": lengths or "cap (no profile)",
        "overrides": cmd[2:],
    }
    result["device_peak_gib"] = result.get(f"gpu{gpu if gpu is not None else 0}_peak_gib")
    if first_step_at is not None and rows:
        result["startup_s"] = round(first_step_at - launched - rows[0].get("timing_s/step", 0.0), 1)
    return result


PHASE_SUM = ("gen", "old_log_prob", "adv", "update_actor", "update_weights")  # old_log_prob includes teacher


def run_phase(size, args) -> dict:
    """`make bench PHASE=step RECIPE=... [ROLLOUT=vllm|hf]`: rows per step; ratio = step / sum of its phases.

    The ratio is the glue check (weight sync, offload, sleep/wake, data movement: target <= 1.15);
    the save (`timing_s/save_checkpoint`) is excluded from both sides. Earlier recipes' results in the
    JSON are kept, so each recipe can run in its own GPU window.
    """

    full = size.name == "full"
    overrides = [] if full else ["+overlay=smoke"]
    if args.save_after:  # save_freq=1 for upstream's loop; the debug key keeps only this step's save
        overrides += ["trainer.save_freq=1", f"opd.debug.save_steps=[{args.save_after}]"]
    else:
        overrides.append("trainer.save_freq=-1")
    overrides += list(args.override or [])
    if args.lengths:
        from opd_patches.hooks import lengths as profiles

        try:
            profiles.schedule(args.lengths)
        except ValueError as exc:
            raise SystemExit(f"[bench step] --lengths (LENGTHS=): {exc}") from None
    names, gpus = list(args.recipe), [str(g) for g in (args.gpus or [])]
    if gpus and len(gpus) < len(names):
        raise SystemExit(f"[bench step] --gpus {' '.join(gpus)}: one GPU per recipe ({' '.join(names)}) is needed "
                         "to run them at the same time; name more GPUs or drop --gpus to run them in turn.")

    def one(i, name):
        workdir = args.workdir / name if gpus else args.workdir  # concurrent runs build their own models
        return run(name, args.steps, args.rollout, workdir, overrides, args.timeout,
                   arch="r1" if full else "embedded", gpu=gpus[i] if gpus else None, lengths=args.lengths)

    if gpus:  # at the same time, one GPU each; launches staggered (below), as in the runs docs/bench/history.md quotes
        from opd_patches.embedded import build as embedded

        embedded.build(REPO / ".cache" / "embedded")  # once here: the threads then find it up to date
        with ThreadPoolExecutor(len(names)) as pool:
            futures = []
            for i, name in enumerate(names):
                futures.append(pool.submit(one, i, name))
                if i + 1 < len(names):
                    time.sleep(15)
            res = [f.result() for f in futures]
    else:
        res = [one(i, name) for i, name in enumerate(names)]
    doc = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    recipes = dict(doc.get("phases", {}).get("step", {}).get("recipes", {}))
    recipes.update({name: r for name, r in zip(names, res)})
    return phase_entry(size.name, recipes)


def phase_entry(size_name: str, recipes: dict) -> dict:
    """The `step` phase's JSON entry: every recipe's runs, one table row per training step."""
    rows = []
    for name, r in sorted(recipes.items()):
        for s in r["steps"]:
            step_s = s.get("timing_s/step", 0.0) - s.get("timing_s/save_checkpoint", 0.0)
            parts = sum(s.get(f"timing_s/{k}", 0.0) for k in PHASE_SUM)
            rows.append({
                "name": f"step/{name}/{r['rollout']}/{s['step']}", "time_s": step_s, "ref_time_s": parts,
                "ratio": step_s / parts if parts else None, "reference": "sum of timing_s phases",
                "tok_per_s": s.get("perf/throughput"), "peak_gib": s.get("actor/perf/max_memory_allocated_gb"),
                **s,
            })
    notes = [f"{n}: {r['rollout']} rollout, {r['steps_done']}/{r['steps_requested']} steps, start-up "
             f"{r.get('startup_s')} s, device peak {r.get('device_peak_gib', r.get('gpu0_peak_gib'))} GiB"
             + (f" (GPU {r['gpu']})" if r.get("gpu") is not None else "")
             + "; per process: " + (", ".join(f"{p['peak_gib']} GiB {p['name'][:40]}" for p in r.get("process_peaks", [])[:4])
                                    or "not reported") for n, r in sorted(recipes.items())]
    notes.append("ratio = timing_s/step (save excluded) / sum of gen, old_log_prob (teacher inside), adv, "
                 "update_actor, update_weights; peak = actor/perf/max_memory_allocated_gb")
    return {"size": size_name, "recipes": recipes, "rows": rows, "notes": notes}
