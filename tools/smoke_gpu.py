"""The GPU smoke behind `make smoke-gpu`: the path users run, end to end, on one GPU with vLLM.

    python -m tools.smoke_gpu [--part train|eval|all|chain] [--recipe topk] [--out outputs/smoke-gpu]
        [--steps 2] [--save-after N] [--max-response-length 1024] [--limit 16] [--timeout 570]

train: random-weight R1-Distill-Qwen-1.5B-architecture student (seed 0) and teacher (seed 1), built in
    code (opd_patches/embedded/r1_arch.py), trained by `run.sh recipe=R` with `DEVICE=gpu`: vLLM rollout
    (recipes/device/gpu.yaml), the colocated teacher and the FSDP update, for 2 steps on the embedded
    prompts, responses capped at 1,024 tokens, one save after the last step (state, HF export, export
    validation, receipt). Checked: exit status 0, every step in metrics.jsonl, the saved state complete
    and its export validated (receipt.json). `--save-after N` (N < steps) saves after step N instead,
    so that the save's stall on training shows in the step after it (`make bench PHASE=step` does the
    same); `--max-response-length 7168` gives the recipes' step figures (the bench's `step` rows are
    written to smoke_gpu.json too).
eval: that export evaluated by the vLLM evaluation backend (`python -m opd_patches.eval --backend vllm`)
    on the built-in `embedded` suite (arithmetic questions generated in code), or, when $OPD_EVAL_DATA is
    set, on its math500 and aime suites (first --limit questions). Checked: exit status 0, summary.json
    with every sample graded, scores.png written.

chain: the real run in one command (`make run`, opd_patches/study/chain.py) on the same random pair at the same
    lengths: a raw DAPO-format file and the math500/aime evaluation sets written here (arithmetic problems, one
    training problem also an evaluation problem, which decontamination must remove), then every stage:
    data-eval, data, preflight, training under a deadline (`--chain-wall-clock` seconds from the launch) with
    one save at the last step, selection on math500 and the final score on aime by the vLLM backend (`--limit`
    questions, one sample each, the same token cap), report.md. Checked: exit status 0, the decontamination,
    the selection's chosen step and final score against the student in report.json, report.md written.

Each part is one process tree; `--part train` and `--part eval` let a 10-minute GPU window run them as
two commands back to back (the start-up, the save and validation of a 1.5B state and a second vLLM
engine do not always fit one, docs/performance.md). Results, with launch-to-exit seconds and per-step phase times, go to
`<out>/smoke_gpu.json` (the two parts merge). Exit status non-zero names the first failed check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def export_of(run_dir: Path, step: int) -> Path:
    return run_dir / f"global_step_{step}" / "actor" / "huggingface"


def check_train(result: dict, run_dir: Path, steps: int, saved: int) -> list[str]:
    """What a user's two-step run promises: exit 0, every step logged, the saved state validated."""
    problems = []
    if result["returncode"] != 0:
        problems.append(f"run.sh exit {result['returncode']} (log: {run_dir / 'run.log'})")
    logged = [row["step"] for row in result["steps"]]
    if logged != list(range(1, steps + 1)):
        problems.append(f"metrics.jsonl logged steps {logged}, expected 1..{steps}")
    receipt_file = run_dir / f"global_step_{saved}" / "receipt.json"
    if not receipt_file.exists():
        problems.append(f"no {receipt_file}: the step-{saved} state is not complete")
    else:
        validation = json.loads(receipt_file.read_text()).get("validation") or {}
        if validation.get("ok") is not True:
            problems.append(f"{receipt_file}: export validation {validation.get('ok')} ({validation.get('error')})")
    return problems


def saved_step(args) -> int:
    return args.save_after or args.steps


def train(args) -> dict:
    from tools.bench import step as bench_step

    overrides = [f"data.max_response_length={args.max_response_length}"]
    if saved_step(args) == args.steps:
        overrides.append(f"trainer.save_freq={args.steps}")
    else:  # as the bench: save_freq=1 for upstream's loop, the debug key keeps only this step's save
        overrides += ["trainer.save_freq=1", f"opd.debug.save_steps=[{saved_step(args)}]"]
    result = bench_step.run(args.recipe, args.steps, "vllm", args.out, overrides + args.override, args.timeout)
    run_dir = args.out / f"run_{args.recipe}"
    problems = check_train(result, run_dir, args.steps, saved_step(args))
    return {**result, "run_dir": str(run_dir), "export": str(export_of(run_dir, saved_step(args))),
            "bench": bench_step.phase_entry("full", {args.recipe: result}), "ok": not problems, "problems": problems}


def eval_suites() -> list[str]:
    return ["math500", "aime"] if os.environ.get("OPD_EVAL_DATA") else ["embedded"]


def held_at_start() -> dict:
    """Free memory of the first visible GPU and each process's holding, read per process through NVML."""
    from opd_patches.eval import gpu_memory

    try:
        r = gpu_memory.read(gpu_memory.visible_devices(1)[0])
    except Exception as exc:  # noqa: BLE001  (no NVML: the evaluation still sizes itself or says why)
        return {"error": repr(exc)}
    return {"gpu": r.index, "free_gib": round(r.free / gpu_memory.GIB, 2), "total_gib": round(r.total / gpu_memory.GIB, 2),
            "holders": [{"pid": h.pid, "name": h.name, "gib": round(h.used / gpu_memory.GIB, 2)} for h in r.holders]}


def evaluate(args) -> dict:
    export = export_of(args.out / f"run_{args.recipe}", saved_step(args))
    if not export.is_dir():
        return {"ok": False, "problems": [f"no export at {export}: run --part train first"]}
    runs, problems = [], []
    for suite in eval_suites():
        out = args.out / "eval" / suite
        subprocess.run(["rm", "-rf", str(out)], check=True)
        cmd = [sys.executable, "-m", "opd_patches.eval", "--model", str(export), "--suite", suite, "--backend", "vllm",
               "--out", str(out), "--limit", str(args.limit), "--samples", "1",
               "--max-new-tokens", str(args.max_response_length)]
        print(f"[smoke-gpu] eval {suite}: {' '.join(cmd)}", flush=True)
        held = held_at_start()
        problems += [f"eval {suite}: the smoke's own process holds {h['gib']} GiB of GPU memory at the evaluation's start"
                     for h in held.get("holders", []) if h["pid"] == os.getpid()]
        start = time.monotonic()
        code = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        run = {"suite": suite, "returncode": code, "wall_s": round(time.monotonic() - start, 1), "out": str(out),
               "gpu_at_start": held}
        summary_file = out / "summary.json"
        if code != 0:
            problems.append(f"eval {suite}: exit {code}")
        elif not summary_file.exists() or not (out / "scores.png").exists():
            problems.append(f"eval {suite}: summary.json or scores.png missing in {out}")
        else:
            summary = json.loads(summary_file.read_text())
            run.update({k: summary.get(k) for k in ("pass_at_1", "n_questions", "n_samples", "truncation_rate",
                                                     "complete", "gpu_memory_utilization")})
            if not summary.get("complete") or summary.get("n_samples") != summary.get("n_questions"):
                problems.append(f"eval {suite}: {summary.get('n_samples')} samples graded for "
                                f"{summary.get('n_questions')} questions")
        runs.append(run)
    return {"runs": runs, "ok": not problems, "problems": problems}


def chain_inputs(folder: Path, limit: int) -> tuple[Path, dict]:
    """A raw DAPO-format file (64 sums) and math500, aime24 and aime25 sets of `limit` problems each; one DAPO
    problem is also math500's first, so the data stage must remove it."""
    folder.mkdir(parents=True, exist_ok=True)
    shared = {"problem": "Compute 7 times 8 plus the square root of 81.", "answer": "65"}
    dapo = folder / "dapo.jsonl"
    rows = [{"problem": f"What is {i} + {3 * i + 1}?", "answer": str(4 * i + 1)} for i in range(64)] + [shared]
    dapo.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = {}
    for k, name in enumerate(("math500", "aime24", "aime25")):
        items = [{"id": f"{name}-{i}", "problem": f"What is {11 + i} times {k + 3}?", "answer": str((11 + i) * (k + 3))}
                 for i in range(limit)]
        if name == "math500":
            items[0] = {"id": f"{name}-0", **shared}
        sets[name] = folder / f"{name}.jsonl"
        sets[name].write_text("".join(json.dumps(r) + "\n" for r in items))
    return dapo, sets


def check_chain(code: int, out: Path) -> list[str]:
    problems = [] if code == 0 else [f"make run exit {code} (logs: {out / 'logs'}, {out / 'train' / 'run.log'})"]
    try:
        report = json.loads((out / "report.json").read_text())
        selection = json.loads((out / "train" / "select" / "selection.json").read_text())
    except (OSError, ValueError) as exc:
        return problems + [f"no report or selection: {exc}"]
    try:
        counts = json.loads((out / "data" / "data_report.json").read_text())["counts"]
    except (OSError, ValueError, KeyError) as exc:
        return problems + [f"no data report: {exc!r}"]
    if counts.get("read", 0) - counts.get("decontaminated", 0) != 1:
        problems.append(f"decontamination removed {counts.get('read', 0) - counts.get('decontaminated', 0)} rows, expected 1")
    final = selection.get("final") or {}
    if selection.get("chosen_step") is None or not final.get("chosen") or not final.get("student"):
        problems.append(f"selection.json has no chosen step or final scores: {sorted(selection)}")
    if not {"train", "select", "final"} <= {s["stage"] for s in report.get("stages", [])}:
        problems.append("report.json lacks the train, select or final stage")
    if not (out / "report.md").is_file():
        problems.append(f"no {out / 'report.md'}")
    return problems


def chain(args) -> dict:
    from tools.bench.step import build_r1_models

    student, teacher = build_r1_models(args.out / "r1_arch", "cuda")
    dapo, sets = chain_inputs(args.out / "chain_inputs", args.limit)
    out = args.out / "chain"
    shutil.rmtree(out, ignore_errors=True)
    cap = args.max_response_length
    cmd = [sys.executable, "-m", "opd_patches.study.chain", "--student", str(student), "--teacher", str(teacher),
           "--dapo", str(dapo), "--recipe", args.recipe, "--out", str(out), "--wall-clock", str(args.chain_wall_clock),
           "--eval-sets", " ".join(f"{name}={path}" for name, path in sets.items()),
           f"--select-args=--samples 1 --limit {args.limit} --max-new-tokens {cap} --cache {args.out / 'chain_cache'}",
           f"data.max_response_length={cap}", f"trainer.total_training_steps={args.steps}",
           f"trainer.save_freq={args.steps}", *args.override]
    print(f"[smoke-gpu] chain: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    try:  # past its deadline by the slack the chain keeps for its own stop, the run hangs
        code = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                              timeout=args.chain_wall_clock + 600).returncode
    except subprocess.TimeoutExpired:
        code = "timed out"
    problems = check_chain(code, out)
    result = {"returncode": code, "wall_s": round(time.monotonic() - start, 1), "out": str(out), "command": cmd[1:],
              "ok": not problems, "problems": problems}
    try:
        report = json.loads((out / "report.json").read_text())
        result.update(stages=report.get("stages"), selection=report.get("selection"))
    except (OSError, ValueError):
        pass  # check_chain named it
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.smoke_gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["train", "eval", "all", "chain"], default="all")
    ap.add_argument("--recipe", default="topk")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "smoke-gpu")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--save-after", type=int, default=None, help="save after this step only (default: the last)")
    ap.add_argument("--max-response-length", type=int, default=1024)
    ap.add_argument("--limit", type=int, default=16, help="questions per evaluation suite")
    ap.add_argument("--timeout", type=int, default=570, help="seconds for the training run")
    ap.add_argument("--chain-wall-clock", type=int, default=3600, help="chain part: seconds from the launch to its deadline")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override for run.sh (repeatable)")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    from tools.bench.step import gpu_visible

    if not gpu_visible():  # asked through NVML: this driver never creates a CUDA context
        print("[smoke-gpu] needs a CUDA GPU with vLLM installed; `make smoke` is the CPU check", file=sys.stderr)
        return 2
    report_file = args.out / "smoke_gpu.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    parts = ["train", "eval"] if args.part == "all" else [args.part]
    for part in parts:
        started = time.monotonic()
        result = {"train": train, "eval": evaluate, "chain": chain}[part](args)
        result["launch_to_exit_s"] = round(time.monotonic() - started, 1)
        report[part] = result
        report_file.write_text(json.dumps(report, indent=1))
        print(f"[smoke-gpu] {part}: {'ok' if result['ok'] else 'FAILED: ' + '; '.join(result['problems'])} "
              f"({result['launch_to_exit_s']} s); {report_file}", flush=True)
        if not result["ok"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
