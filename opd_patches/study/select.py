"""`make select RUN=...` = `python -m opd_patches.study.select RUN [--proxy math500] [--final aime]
[--student PATH] [--samples N] [--max-new-tokens T] [--limit N] [--backend auto|hf|vllm] [--data-dir DIR]
[--cache DIR]`: the seed's checkpoint selection for one training run.

1. The HF export of every kept state of RUN that is complete and validated (ops/receipts.py) is evaluated
   on the proxy suite (MATH-500 x 4 by default). Any other state folder is listed as skipped, with why
   (incomplete, export validation failed, export not validated).
2. Ranking (`rank`): pass@1 with its question-clustered SE, and each export's difference against the best,
   paired by question (eval/stats.py `paired_difference`). The choice is the best, except that among the
   exports within one paired SE of it the latest step wins: a difference the proxy cannot resolve is no
   evidence against the furthest-trained export.
3. The chosen export is evaluated on the final suite (AIME 2024+2025 x 32 by default); `--samples`,
   `--max-new-tokens` and `--limit` apply to both suites.
4. The student (`--student`, else `actor_rollout_ref.model.path` of RUN/manifest.json) is evaluated on both
   suites once: into a cache shared by every run, keyed by the digest of its files (`model_digest`), at
   `<cache>/<digest>/<suite>/` (default cache ~/.cache/opd/evals), which any later selection reuses.
   The final suite gives the paired difference chosen - student.

Output in `<run>/select/`, beside the trainer's global_step_* folders (which pruning deletes):
`evals/global_step_N/<suite>/` (the harness's own folders), `selection.json`, `selection.md`.

The evaluations are the study's jobs (evaluate.py): one process each, skipped when complete for the same
model and settings, resumed where interrupted; settings other than the protocol's get folders of their own
(`evaluate.settings_folder`). A rerun after more training evaluates only the new exports.

Exit status: 0 done; 1 an evaluation failed (its log is named); 2 bad input (one line); 130 interrupted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from opd_patches.eval import stats
from opd_patches.eval.suites import default_data_dir, load_protocol, load_questions, suite_names
from opd_patches.ops import checkpoints, receipts
from opd_patches.study import evaluate, report
from opd_patches.study.progress import human

DEFAULT_CACHE = Path.home() / ".cache" / "opd" / "evals"
FOLDER = "select"
RULE = ("pass@1 = mean over questions of each question's mean over its samples; SE = question-clustered (std of "
        "per-question means / sqrt(questions)); diff vs best = paired by question, its SE = std of the per-question "
        "differences / sqrt(questions); chosen = the latest step among the exports within one paired SE of the best "
        "(the best included)")
DIFF_KEYS = ("diff", "se", "t", "p_value", "verdict", "n_common")


class SelectError(ValueError):
    """Input the selection cannot work with; printed as one line, exit status 2."""


def log(msg: str) -> None:
    print(f"[select] {msg}", flush=True)


def candidates(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(eligible, skipped), oldest first: {step, export, digest} of each complete, validated state (digest:
    `export_digest`); {step, reason} of every other state folder."""
    eligible, skipped = [], []
    for s in checkpoints.list_states(run_dir):
        if not s["complete"]:
            skipped.append({"step": s["step"], "reason": f"incomplete ({s['reason']})"})
        elif s["validated"] is not True:
            error = ((receipts.read(s["path"], s["step"]) or {}).get("validation") or {}).get("error")
            why = "export validation failed" if s["validated"] is False else "export not validated"
            skipped.append({"step": s["step"], "reason": why + (f" ({error})" if error and error != "not validated" else "")})
        else:
            eligible.append({"step": s["step"], "export": evaluate.export_of(s["path"]),
                             "digest": export_digest(receipts.read(s["path"], s["step"]))})
    return eligible, skipped


def rank(per_step: dict) -> list[dict]:
    """The ranking of `{step: results}` (results: `{question: [0/1, ...]}`, the same questions for every
    step), one row per step, oldest first: pass@1, its clustered SE, the paired difference against the best
    and its SE, whether it lies within one SE of the best, and which one is chosen (see the module
    docstring). Equal pass@1 make the latest of them the best."""
    if not per_step:
        raise ValueError("rank: no results to rank")
    scores = {step: stats.pass_at_1(r) for step, r in per_step.items()}
    best = max(scores, key=lambda step: (scores[step]["mean"], step))
    rows = []
    for step in sorted(per_step):
        d = stats.paired_difference(per_step[step], per_step[best], f"step {step}", f"step {best}")
        # one question: no SE; only an exact tie counts as within
        within = d["diff"] == 0.0 if math.isnan(d["se"]) else -d["diff"] <= d["se"]
        rows.append({"step": step, "pass_at_1": scores[step]["mean"], "se": report.finite(scores[step]["clustered_se"]),
                     "n_questions": scores[step]["n_questions"], "diff_vs_best": d["diff"],
                     "se_diff": report.finite(d["se"]), "within_one_se": within, "best": step == best})
    chosen = max(r["step"] for r in rows if r["within_one_se"])
    for r in rows:
        r["chosen"] = r["step"] == chosen
    return rows


def _combine(digests: dict) -> str:
    h = hashlib.sha256()
    for rel in sorted(digests):
        h.update(f"{rel}\0{digests[rel]}\n".encode())
    return h.hexdigest()


def model_digest(folder: Path) -> str:
    """The identity of a model's content: sha256 over each file's relative path and `sha256_blocks`
    (receipts.hash_files), so that a copy of the student elsewhere hits the same cache entry."""
    files = receipts.hash_files(folder, receipts.state_files(folder))
    return _combine({rel: meta[receipts.DIGEST] for rel, meta in files.items()})


def export_digest(receipt: dict) -> str | None:
    """`model_digest` of a state's HF export from the digests its receipt holds (nothing read again), so
    that the run's evaluations stay its own after the run folder moves; None for a receipt of plain
    `sha256` digests (the export is then known by its path)."""
    prefix = (receipt.get("hf_export") or receipts.HF_EXPORT).rstrip("/") + "/"
    files = {rel[len(prefix):]: meta.get(receipts.DIGEST) for rel, meta in receipt["files"].items() if rel.startswith(prefix)}
    return _combine(files) if files and all(files.values()) else None


def student_of(run_dir: Path) -> str | None:
    """The model the run trained from, as its manifest records it (`actor_rollout_ref.model.path`)."""
    try:
        return json.loads((run_dir / "manifest.json").read_text())["config"]["actor_rollout_ref"]["model"]["path"] or None
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class Plan:
    run_dir: Path
    out: Path
    proxy: str
    final: str
    eval_spec: dict
    eligible: list
    skipped: list
    student: Path
    digest: str
    cache: Path

    def job(self, suite: str, candidate: dict | None = None) -> evaluate.EvalJob:
        """The evaluation of a candidate (`candidates`' row) on `suite`, or of the student (None)."""
        folder = evaluate.settings_folder(suite, self.eval_spec)
        if candidate is None:  # in the shared cache
            return evaluate.EvalJob(None, evaluate.REFERENCE, None, suite, self.cache / self.digest / folder,
                                    self.student, ref="student", model_hash=self.digest)
        step = candidate["step"]
        return evaluate.EvalJob(None, f"step {step}", step, suite, self.out / "evals" / f"global_step_{step}" / folder,
                                candidate["export"], model_hash=candidate["digest"])


def prepare(args) -> Plan:
    """Every input checked before anything is evaluated; SelectError names what is wrong."""
    run_dir = Path(args.run).resolve()
    if not run_dir.is_dir():
        raise SelectError(f"no such run folder: {args.run}")
    for flag, suite in (("--proxy", args.proxy), ("--final", args.final)):
        try:
            load_protocol(suite)
        except ValueError:
            raise SelectError(f"{flag} {suite}: unknown suite; known: {', '.join(suite_names())}, or a protocol .yaml path") from None
    data_dir = Path(args.data_dir).resolve() if args.data_dir else None
    ids = {}
    for suite in (args.proxy, args.final):
        try:
            ids[suite] = {q["id"] for q in load_questions(load_protocol(suite), data_dir or default_data_dir(), args.limit)}
        except (OSError, ValueError) as exc:
            raise SelectError(str(exc).splitlines()[0]) from None
    eligible, skipped = candidates(run_dir)
    if not eligible:
        listed = "; ".join(f"step {s['step']}: {s['reason']}" for s in skipped) or "no global_step_N folders"
        raise SelectError(f"no complete, validated export in {run_dir} ({listed})")
    given = args.student or student_of(run_dir)
    if not given:
        raise SelectError(f"no student: {run_dir / 'manifest.json'} records no actor_rollout_ref.model.path; "
                          "give it with --student (make select STUDENT=...)")
    from opd_patches.checks.models import check_model

    try:
        student = check_model(given, "--student" if args.student else "the manifest's actor_rollout_ref.model.path").resolve()
    except ValueError as exc:
        raise SelectError(str(exc).splitlines()[0]) from None
    shared = ids[args.proxy] & ids[args.final]
    if shared:
        log(f"warning: {args.proxy} and {args.final} share {len(shared)} questions: the final score is then not "
            "independent of the choice")
    eval_spec = {"limit": args.limit, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
                 "temperature": None, "top_p": None, "seed": None, "backend": args.backend,
                 "data_dir": str(data_dir) if data_dir else None, "args": [], "teacher_kl": None, "kl_samples": None}
    cache = Path(args.cache).expanduser().resolve() if args.cache else DEFAULT_CACHE
    return Plan(run_dir, run_dir / FOLDER, args.proxy, args.final, eval_spec, eligible, skipped, student,
                model_digest(student), cache)


def evaluate_one(plan: Plan, job: evaluate.EvalJob, what: str) -> dict | None:
    """Run (or reuse) one evaluation with a progress line; its {pass_at_1, se, n_questions, eval, results},
    or None when it failed."""
    if not evaluate.is_done(job, plan.eval_spec):
        log(f"{what}: evaluating into {job.out} (log {job.out / 'eval.log'})")
    res = evaluate.run_job(job, plan.eval_spec)
    results = report.eval_results(job.out) if res["state"] in ("done", "skipped") else None
    if results is None:
        log(f"{what}: FAILED: {res['detail']}")
        return None
    p = stats.pass_at_1(results)
    score = f"pass@1 {p['mean']:.4f} +/- {report.finite(p['clustered_se']) or 0:.4f}"
    if res["state"] == "done":
        new = (evaluate.read_summary(job) or {}).get("generated_this_run")
        log(f"{what}: evaluated: {score} ({human(res['seconds'])}, {new} new samples)")
    else:
        log(f"{what}: reused: {score} ({job.out})")
    return {"pass_at_1": p["mean"], "se": report.finite(p["clustered_se"]), "n_questions": p["n_questions"],
            "eval": str(job.out), "results": results}


def _public(block: dict | None) -> dict | None:
    return None if block is None else {k: v for k, v in block.items() if k != "results"}


def run(plan: Plan) -> int:
    ok = True
    n = len(plan.eligible)
    log(f"{plan.run_dir}: {n} export{'s' if n != 1 else ''} to rank on {plan.proxy} (steps "
        f"{', '.join(str(c['step']) for c in plan.eligible)}); student {plan.student} (digest {plan.digest[:12]})"
        + "".join(f"; skipped step {s['step']}: {s['reason']}" for s in plan.skipped))
    proxy = {}
    for i, c in enumerate(plan.eligible, 1):
        block = evaluate_one(plan, plan.job(plan.proxy, c), f"proxy {i}/{n} step {c['step']} ({plan.proxy})")
        ok &= block is not None
        if block is not None:
            proxy[c["step"]] = block
    if not ok:
        log("not chosen: an export's proxy evaluation failed (its log is named above); the same command retries it")
        return 1
    rows = rank({step: b["results"] for step, b in proxy.items()})
    chosen = next(r for r in rows if r["chosen"])
    best = next(r for r in rows if r["best"])
    pick = next(c for c in plan.eligible if c["step"] == chosen["step"])
    log(f"chosen: step {chosen['step']} (best on {plan.proxy}: step {best['step']}, pass@1 {best['pass_at_1']:.4f})")
    final = evaluate_one(plan, plan.job(plan.final, pick), f"final step {chosen['step']} ({plan.final})")
    student_proxy = evaluate_one(plan, plan.job(plan.proxy), f"student ({plan.proxy})")
    student_final = evaluate_one(plan, plan.job(plan.final), f"student ({plan.final})")
    ok = all(b is not None for b in (final, student_proxy, student_final))
    data = selection(plan, rows, proxy, final, student_proxy, student_final)
    receipts.atomic_write_json(plan.out / "selection.json", data)
    md = markdown(data)
    tmp = plan.out / "selection.md.tmp"
    tmp.write_text(md)
    tmp.replace(plan.out / "selection.md")
    print(md, flush=True)
    log(f"wrote {plan.out / 'selection.json'}, {plan.out / 'selection.md'}")
    return 0 if ok else 1


def selection(plan: Plan, rows: list, proxy: dict, final, student_proxy, student_final) -> dict:
    """selection.json's content."""
    chosen = next(r for r in rows if r["chosen"])
    best = next(r for r in rows if r["best"])
    for r in rows:
        r["eval"] = proxy[r["step"]]["eval"]
    student = {"model": str(plan.student), "digest": plan.digest, "proxy": _public(student_proxy), "final": _public(student_final)}
    if student_proxy is not None:
        d = stats.paired_difference(student_proxy["results"], proxy[best["step"]]["results"], "student", f"step {best['step']}")
        student["proxy"].update(diff_vs_best=d["diff"], se_diff=report.finite(d["se"]))
    versus = None
    if final is not None and student_final is not None:
        versus = report.json_block(stats.paired_difference(final["results"], student_final["results"],
                                                           f"step {chosen['step']}", "student"), DIFF_KEYS)
    return {
        "run": str(plan.run_dir), "rule": RULE,
        "proxy_suite": {"suite": plan.proxy, **evaluate.settings(plan.proxy, plan.eval_spec)},
        "final_suite": {"suite": plan.final, **evaluate.settings(plan.final, plan.eval_spec)},
        "ranking": rows, "skipped": plan.skipped, "best_step": best["step"], "chosen_step": chosen["step"],
        "chosen_export": str(next(c["export"] for c in plan.eligible if c["step"] == chosen["step"])),
        "final": {"chosen": None if final is None else {"step": chosen["step"], **_public(final)},
                  "student": _public(student_final), "chosen_vs_student": versus},
        "student": student,
    }


def _n(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(data: dict) -> str:
    """selection.md: the ranking and the final scores as tables."""
    p, f = data["proxy_suite"], data["final_suite"]

    def setting(s):
        limit = f", first {s['limit']} questions" if s["limit"] else ""
        return f"`{s['suite']}` ({s['samples']} samples per question, at most {s['max_new_tokens']} new tokens{limit})"

    lines = [f"# Checkpoint selection of `{data['run']}`", "",
             f"Proxy suite {setting(p)}; final suite {setting(f)}.", "", f"Rule: {data['rule']}.", "",
             f"## Proxy: {p['suite']}", "",
             "| step | pass@1 | SE | diff vs best | SE diff | within 1 SE | chosen |", "|---|---|---|---|---|---|---|"]
    for r in data["ranking"]:
        within = ("yes (best)" if r["best"] else "yes") if r["within_one_se"] else "no"
        lines.append(f"| {r['step']} | {r['pass_at_1']:.3f} | {_n(r['se'])} | {r['diff_vs_best']:+.3f} | "
                     f"{_n(r['se_diff'])} | {within} | {'**chosen**' if r['chosen'] else ''} |")
    sp = data["student"]["proxy"]
    if sp is not None:
        lines.append(f"| student | {sp['pass_at_1']:.3f} | {_n(sp['se'])} | {sp['diff_vs_best']:+.3f} | {_n(sp['se_diff'])} | | |")
    if data["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"step {s['step']}: {s['reason']}" for s in data["skipped"]) + "."]
    fin = data["final"]
    lines += ["", f"## Final: {f['suite']}", "", "| model | pass@1 | SE | questions |", "|---|---|---|---|"]
    for name, b in ((f"step {data['chosen_step']} (chosen)", fin["chosen"]), ("student", fin["student"])):
        lines.append(f"| {name} | {_n(b and b['pass_at_1'])} | {_n(b and b['se'])} | {b['n_questions'] if b else '-'} |")
    v = fin["chosen_vs_student"]
    if v is not None:
        lines += ["", f"Chosen - student, paired by question: {v['verdict']}."]
    lines += ["", f"Student: `{data['student']['model']}` (digest {data['student']['digest'][:12]}); chosen export: "
                  f"`{data['chosen_export']}`."]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m opd_patches.study.select", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="the run folder (its global_step_N/ states)")
    ap.add_argument("--proxy", default="math500", help="the suite that ranks the exports (default math500)")
    ap.add_argument("--final", default="aime", help="the suite that scores the chosen export and the student (default aime)")
    ap.add_argument("--student", help="the model the run started from (default: the run manifest's actor_rollout_ref.model.path)")
    ap.add_argument("--samples", type=int, help="samples per question on both suites (default: each protocol's)")
    ap.add_argument("--max-new-tokens", type=int, help="token cap on both suites (default: each protocol's)")
    ap.add_argument("--limit", type=int, help="only the first N questions of each suite")
    ap.add_argument("--backend", choices=["auto", "hf", "vllm"], default="auto")
    ap.add_argument("--data-dir", help="folder of the suites' JSONL files (default $OPD_EVAL_DATA, else ~/data/opd-eval)")
    ap.add_argument("--cache", help=f"the student's evaluations, shared by every run (default {DEFAULT_CACHE})")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    for flag in ("samples", "max_new_tokens", "limit"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            print(f"[select] error: --{flag.replace('_', '-')} {getattr(args, flag)}: give a positive number", file=sys.stderr)
            return 2
    try:
        plan = prepare(args)
    except SelectError as exc:
        print(f"[select] error: {exc}", file=sys.stderr)
        return 2
    try:
        return run(plan)
    except KeyboardInterrupt:
        log("interrupted; the evaluation it had started was stopped; the same command resumes it")
        return 130


if __name__ == "__main__":
    sys.exit(main())
