"""Evaluations of a study: which checkpoints of each run, and the evaluation harness on each.

One evaluation = (run, checkpoint step, suite), in `<out>/evals/<arm>/seed<S>/global_step_<N>/<suite>/`
(outside the run folder: the trainer prunes old states, evaluations stay). Its model is the state's HF
export (the receipt's `hf_export`, `actor/huggingface`). Checkpoints (`eval.checkpoints`):
- `last`: the run's newest complete state, labelled "last" (runs stopped by a wall clock may end at
  different steps; they are still compared as "last");
- `every`: every complete state on disk when the evaluations start (the trainer keeps
  `trainer.max_actor_ckpt_to_keep` of them), labelled "step N";
- `[N, ...]`: those steps, labelled "step N"; one not on disk (never saved, or pruned: raise
  trainer.max_actor_ckpt_to_keep) is reported as missing.

A spec's `references` (models evaluated as they are, e.g. the student a study starts from and its
teacher) get one evaluation per suite in `<out>/evals/_references/<name>/<suite>/`, labelled "reference".
With `eval.teacher_kl` every evaluation also measures the model's teacher-KL (`--teacher-kl`).

Each runs `python -m opd_patches.eval` in a process of its own (the GPU memory of one model is freed
before the next). An evaluation whose summary.json is complete for the same model and settings is
skipped (an option left unset means the protocol's value; a job with a `model_hash` is the same model
when the digest of its files is, wherever they lie); an interrupted one resumes from its
generations.jsonl (the harness's own resume). `make select` (select.py) runs its evaluations through
the same jobs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from opd_patches.eval.suites import load_protocol
from opd_patches.ops import checkpoints, receipts
from opd_patches.study.runner import RunPlan, run_child, shared_cores_env
from opd_patches.study.spec import suite_folder

# spec eval key -> the harness's command-line flag (and its summary["protocol"] key)
OPTIONS = {"limit": "--limit", "samples": "--samples", "max_new_tokens": "--max-new-tokens",
           "temperature": "--temperature", "top_p": "--top-p", "seed": "--seed"}
# the options that change what one sample means (the harness refuses to mix them in one folder)
SAMPLE_OPTIONS = ("max_new_tokens", "temperature", "top_p", "seed")


REFERENCE = "reference"


@dataclass
class EvalJob:
    plan: RunPlan | None  # None: a reference model
    label: str     # "last", "step N" or "reference": what the report groups by
    step: int | None
    suite: str
    out: Path
    model: Path | None
    missing: str = ""  # why there is nothing to evaluate (the step is not on disk)
    ref: str = ""      # the reference's name
    model_hash: str | None = None  # set: the model is identified by the digest of its files, not its path

    @property
    def name(self) -> str:
        if self.plan is None:
            return f"reference {self.ref} {self.suite}"
        return f"{self.plan.arm} seed {self.plan.seed} {self.label} (step {self.step}) {self.suite}"


def reference_jobs(spec, out: Path) -> list[EvalJob]:
    jobs = []
    for name, model in spec.references.items():
        for suite in spec.eval["suites"]:
            folder = out / "evals" / "_references" / name / suite_folder(suite)
            missing = "" if Path(model).exists() else f"reference {name}: no model folder {model}"
            jobs.append(EvalJob(None, REFERENCE, None, suite, folder, Path(model), missing=missing, ref=name))
    return jobs


def export_of(state_dir: Path) -> Path:
    """The HF export of a state folder (its receipt's `hf_export`)."""
    try:
        rel = receipts.read(state_dir, int(state_dir.name.split("_")[-1])).get("hf_export") or receipts.HF_EXPORT
    except (AttributeError, ValueError):
        rel = receipts.HF_EXPORT
    return (state_dir / rel).resolve()


def jobs_for(plan: RunPlan, eval_spec: dict, out: Path) -> list[EvalJob]:
    complete = {s["step"]: s["path"] for s in checkpoints.list_states(plan.run_dir) if s["complete"]}
    mode = eval_spec["checkpoints"]
    if mode == "last":
        picks = [("last", max(complete))] if complete else []
    elif mode == "every":
        picks = [(f"step {n}", n) for n in sorted(complete)]
    else:
        picks = [(f"step {n}", n) for n in mode]
    jobs = []
    for label, step in picks:
        for suite in eval_spec["suites"]:
            folder = out / "evals" / plan.arm / f"seed{plan.seed}" / f"global_step_{step}" / suite_folder(suite)
            if step in complete:
                jobs.append(EvalJob(plan, label, step, suite, folder, export_of(Path(complete[step]))))
            else:
                why = (f"step {step} is not a complete state of {plan.run_dir} (complete: {sorted(complete)}); "
                       "it was not saved (trainer.save_freq) or was pruned (raise trainer.max_actor_ckpt_to_keep)")
                jobs.append(EvalJob(plan, label, step, suite, folder, None, missing=why))
    return jobs


def read_summary(job: EvalJob) -> dict | None:
    try:
        return json.loads((job.out / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def settings(suite: str, eval_spec: dict) -> dict:
    """The options an evaluation of `suite` runs with: the spec's, else the protocol's (limit: none)."""
    protocol = load_protocol(suite)
    return {k: eval_spec[k] if eval_spec.get(k) is not None else protocol.get(k) for k in OPTIONS}


def settings_folder(suite: str, eval_spec: dict) -> str:
    """The folder name of an evaluation: the suite's, with each sample option that differs from the
    protocol's appended (`aime-max_new_tokens=8192`), so that other settings get a folder of their own
    instead of a refusal to mix."""
    protocol = load_protocol(suite)
    return suite_folder(suite) + "".join(f"-{k}={eval_spec[k]}" for k in SAMPLE_OPTIONS
                                         if eval_spec.get(k) is not None and eval_spec[k] != protocol[k])


def is_done(job: EvalJob, eval_spec: dict) -> bool:
    """A complete summary for this model with the requested settings (options left unset: protocol's)."""
    s = read_summary(job)
    if not s or not s.get("complete"):
        return False
    if (s.get("model_hash") != job.model_hash) if job.model_hash else (s.get("model") != str(job.model)):
        return False
    protocol = s.get("protocol") or {}
    if eval_spec.get("teacher_kl") and (s.get("teacher_kl") or {}).get("teacher") != eval_spec["teacher_kl"]:
        return False
    want = settings(job.suite, eval_spec)
    return all(protocol.get(k) == want[k] for k in OPTIONS)


def command(job: EvalJob, eval_spec: dict) -> list[str]:
    cmd = [sys.executable, "-m", "opd_patches.eval", "--model", str(job.model), "--suite", job.suite,
           "--out", str(job.out), "--backend", eval_spec["backend"]]
    if job.step is not None:
        cmd += ["--step", str(job.step)]
    if job.model_hash:
        cmd += ["--model-hash", job.model_hash]
    if eval_spec.get("teacher_kl"):
        cmd += ["--teacher-kl", eval_spec["teacher_kl"], "--kl-samples", str(eval_spec.get("kl_samples") or 1)]
    for key, flag in OPTIONS.items():
        if eval_spec[key] is not None:
            cmd += [flag, str(eval_spec[key])]
    if eval_spec["data_dir"]:
        cmd += ["--data-dir", eval_spec["data_dir"]]
    return cmd + list(eval_spec["args"])


def run_job(job: EvalJob, eval_spec: dict, shared_cores: bool = False) -> dict:
    """Run (or skip) one evaluation: {"state": done|skipped|missing|failed, "detail", "seconds"}."""
    if job.missing:
        return {"state": "missing", "detail": job.missing, "seconds": 0.0}
    if is_done(job, eval_spec):
        return {"state": "skipped", "detail": "already complete", "seconds": 0.0}
    started = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if shared_cores:  # beside a training (eval.during_training)
        env = shared_cores_env(env)
    code = run_child(command(job, eval_spec), env, job.out / "eval.log")
    seconds = round(time.monotonic() - started, 1)
    s = read_summary(job)
    if code != 0 or not s or not s.get("complete"):
        tail = (job.out / "eval.log").read_text(errors="replace").splitlines()[-5:]
        return {"state": "failed", "detail": f"exit {code}; log {job.out / 'eval.log'}: " + " | ".join(tail), "seconds": seconds}
    kl = s.get("teacher_kl")
    tail = f", teacher-KL {kl['teacher_kl']:.4f}" if kl else ""
    return {"state": "done", "detail": f"pass@1 {s['pass_at_1']:.4f} +/- {s['se_clustered']:.4f}{tail}", "seconds": seconds}
