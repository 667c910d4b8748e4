"""One evaluation run: sample every (question, sample) pair of a suite, grade, summarise, plot.

Resumable from its own output: `<out>/generations.jsonl` gets one line per graded sample as soon as its
batch is done; a rerun with the same `--out` reads it back (a cut-off last line is dropped and the file
rewritten without it), skips the pairs already there and samples only the rest. The settings that
change what a sample means (model, suite, max_new_tokens, temperature, top_p, seed) are kept in
`<out>/eval_config.json` and a rerun with different ones is refused; `--samples` and `--limit` may
change (the summary covers the pairs requested now; other lines stay in the file). With `--model-hash`
(a digest of the model's files, given by a caller that keys evaluations by content: `make select`'s
student cache) the model is the same when the digest is, wherever its folder now is.

Order of work: (1) generation in chunks of the backend's batch size, each sample rule-graded
(`opd_patches.task.grader.grade`) and appended; (2) only with `--verifier`: the evaluated model is released,
the judge model loaded on the same backend, and every sample the rule grader could not decide (and no
judge has seen) is judged, the file rewritten; (3) `summary.json` and `scores.png`. A progress line
per chunk gives samples done, tokens/s, the remaining time at that pace and the running accuracy.

Before generating it prints an estimate: pending samples x max_new_tokens (every sample at the cap;
one that stops at its EOS takes less) over a decode rate, measured on one batch for the hf backend, assumed for vllm
(VLLM_ASSUMED_TOKENS_PER_S, the order of a 1.5B model's batched decode on one GPU: measuring it would
cost a batch of vLLM generation before the run).
"""

from __future__ import annotations

import gc
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from opd_patches.task import prompt as prompt_template
from opd_patches.eval import summary as summary_mod
from opd_patches.eval.backends import make_backend, sample_seed
from opd_patches.eval.suites import default_data_dir, load_protocol, load_questions
from opd_patches.task.grader import RULE_VERDICTS, grade

VLLM_ASSUMED_TOKENS_PER_S = 10_000.0
MUST_MATCH = ("model", "suite", "max_new_tokens", "temperature", "top_p", "seed")
KL_FILE = "teacher_kl.json"


def log(msg: str) -> None:
    print(f"[eval] {msg}", flush=True)


def human_duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} hours"
    if seconds >= 60:
        return f"{seconds / 60:.1f} minutes"
    return f"{seconds:.0f} s"


def default_out(model: str, suite: str) -> Path:
    """`<run>/global_step_N/eval/<suite>` for a checkpoint, else `outputs/eval/<model name>/<suite>`."""
    path = Path(model)
    for parent in [path, *path.parents]:
        if summary_mod.step_of(parent.name) is not None:
            return parent / "eval" / suite
    return Path("outputs") / "eval" / path.name / suite


def _check_config(out: Path, config: dict) -> None:
    path = out / "eval_config.json"
    # Settings only matter once samples exist: a run that failed before sampling blocks nothing.
    if path.exists() and summary_mod.load_records(out / "generations.jsonl")[0]:
        old = json.loads(path.read_text())
        same_files = config.get("model_hash") is not None and old.get("model_hash") == config["model_hash"]
        diff = [f"{k}: {old.get(k)!r} -> {config[k]!r}" for k in MUST_MATCH
                if old.get(k) != config[k] and not (k == "model" and same_files)]
        for key in ("backend", "gpu_memory_utilization", "prompt_opens_thought"):  # kept when a resume generates nothing
            config.setdefault(key, old.get(key))
        if diff:
            raise ValueError(
                f"{out} holds an evaluation with other settings ({'; '.join(diff)}); its samples would mix. "
                "Use another --out, or delete the folder to start again"
            )
    _write_atomic(path, json.dumps(config, indent=2) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_records(path: Path, records: list[dict]) -> None:
    _write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def _rule_grade(item: dict, completion, timeout_s: float, prompt_opened_thought: bool = False) -> dict:
    result = grade(completion.text, item["gold"], timeout_s=timeout_s, prompt_opened_thought=prompt_opened_thought)
    return {
        **item,
        "response": completion.text,
        "n_tokens": completion.n_tokens,
        "finish_reason": completion.finish_reason,
        "truncated": completion.finish_reason == "length",
        "unfinished_thought": result.unfinished_thought,
        "extracted": result.extracted,
        "correct": result.correct,
        "grader": "rule",
        "decided_by": result.decided_by,
        "reason": result.reason,
    }


def estimate(backend, n_pending: int, max_new_tokens: int, sample_prompt: str) -> dict:
    """Print (and return) the time estimate for `n_pending` samples."""
    if backend.name == "hf":
        rate, how = backend.measure_tokens_per_second(sample_prompt), "measured on one batch, short context"
    else:
        rate, how = VLLM_ASSUMED_TOKENS_PER_S, "assumed (a 1.5B model on one current data-centre GPU; docs/evaluation.md)"
    tokens = n_pending * max_new_tokens
    seconds = tokens / rate
    log(f"estimate: {n_pending:,d} samples x up to {max_new_tokens:,d} new tokens = {tokens / 1e6:,.2f} M tokens; "
        f"at {rate:,.0f} tokens/s ({how}): about {human_duration(seconds)} with every sample at the cap "
        "(samples that stop early take less; long contexts decode slower than this rate)")
    if backend.name == "hf" and seconds > 86400:
        log("WARNING: on the hf backend this suite takes DAYS. Install vLLM (make install PROFILE=gpu) and use "
            "--backend vllm, or pass --limit / --samples for a partial run")
    return {"tokens": tokens, "tokens_per_s": rate, "rate_source": how, "seconds_upper_bound": seconds}


def run_verifier(records: list[dict], questions: dict, args, backend_name: str, max_model_len: int) -> int:
    """Judge the rule-undecided, not yet judged records in place; returns how many were judged."""
    from opd_patches.eval.verifier import Verifier, apply_verdict

    todo = [r for r in records if r["decided_by"] not in RULE_VERDICTS and "verifier" not in r]
    if not todo:
        log("verifier: nothing to judge (the rule grader decided every sample)")
        return 0
    log(f"verifier: {len(todo)} samples the rule grader could not decide -> {args['verifier']}")
    backend = make_backend(backend_name, args["verifier"], max_model_len, args.get("batch_size"),
                           gpu_memory=args.get("gpu_memory_utilization"))
    verifier = Verifier(backend, args["verifier"], args["verifier_max_new_tokens"], args.get("verifier_prompt"))
    verdicts = verifier.judge([(questions[r["id"]]["problem"], r["gold"], r["extracted"] or "") for r in todo])
    for r, (verdict, raw) in zip(todo, verdicts):
        apply_verdict(r, verdict, raw, args["verifier"])
    return len(todo)


def run(args: dict) -> dict:
    """Run one evaluation; `args` are the CLI's (see `opd_patches.eval.cli`). Returns the summary."""
    started = time.time()
    protocol = load_protocol(args["suite"])
    for key in ("samples", "max_new_tokens", "temperature", "top_p", "seed"):
        if args.get(key) is not None:
            protocol[key] = args[key]
    data_dir = Path(args.get("data_dir") or default_data_dir())
    questions = load_questions(protocol, data_dir, args.get("limit"))
    from opd_patches.checks.models import check_model

    check_model(args["model"], "MODEL")  # before anything is written or loaded
    if args.get("teacher_kl"):
        check_model(args["teacher_kl"], "--teacher-kl")
    out = Path(args.get("out") or default_out(args["model"], protocol["name"]))
    out.mkdir(parents=True, exist_ok=True)
    model = str(Path(args["model"]).resolve()) if Path(args["model"]).exists() else args["model"]
    step = args.get("step") if args.get("step") is not None else summary_mod.step_of(model)
    config = {"suite": protocol["name"], "protocol_file": protocol["protocol_file"], "model": model,
              "model_hash": args.get("model_hash"), "step": step,
              **{k: protocol[k] for k in ("samples", "max_new_tokens", "temperature", "top_p", "seed")},
              "limit": args.get("limit"), "data_dir": str(data_dir), "verifier": args.get("verifier")}
    _check_config(out, config)

    gen_path = out / "generations.jsonl"
    records, bad = summary_mod.load_records(gen_path)
    seen, unique = set(), []
    for r in records:
        if (r["id"], r["sample"]) not in seen:
            seen.add((r["id"], r["sample"]))
            unique.append(r)
    if bad or len(unique) != len(records):
        log(f"resume: dropped {bad} unreadable line(s) and {len(records) - len(unique)} duplicate(s) from {gen_path}")
        _write_records(gen_path, unique)
    records = unique
    wanted = [(q, k) for q in questions for k in range(protocol["samples"])]
    pending = [(q, k) for q, k in wanted if (q["id"], k) not in seen]
    log(f"{protocol['name']}: {len(questions)} questions x {protocol['samples']} samples, max {protocol['max_new_tokens']} "
        f"new tokens, T={protocol['temperature']}, top_p={protocol['top_p']}, seed {protocol['seed']}; "
        f"{len(wanted) - len(pending)} done in {gen_path}, {len(pending)} to sample")

    backend_name = args.get("backend") or "auto"
    timeout_s = float(args.get("grade_timeout_s") or 10.0)
    generated, est = 0, None
    if pending:
        backend = make_backend(backend_name, args["model"], _max_model_len(questions, protocol), args.get("batch_size"),
                               protocol["seed"], gpu_memory=args.get("gpu_memory_utilization"))
        backend_name = backend.name
        config["backend"] = backend.description
        config["gpu_memory_utilization"] = getattr(backend, "gpu_memory_utilization", None)
        _write_atomic(out / "eval_config.json", json.dumps(config, indent=2) + "\n")
        tok = backend.tokenizer
        prompts = {q["id"]: prompt_template.render(tok, q["problem"]) for q in questions}
        # R1's template opens a thought in the prompt: the grader needs it (as the training reward has it)
        opened = prompt_template.opens_thought(tok)
        config["prompt_opens_thought"] = opened
        _write_atomic(out / "eval_config.json", json.dumps(config, indent=2) + "\n")
        est = estimate(backend, len(pending), protocol["max_new_tokens"], prompts[pending[0][0]["id"]])
        workers = max(1, int(os.environ.get("OPD_GRADER_WORKERS", "1")))
        t0, n_tokens, n_correct = time.time(), 0, 0
        with open(gen_path, "a") as fh, ThreadPoolExecutor(workers) as pool:
            for start in range(0, len(pending), backend.batch_size):
                chunk = pending[start : start + backend.batch_size]
                seeds = [sample_seed(protocol["seed"], q["id"], k) for q, k in chunk]
                outs = backend.generate([prompts[q["id"]] for q, _ in chunk], protocol["max_new_tokens"],
                                        protocol["temperature"], protocol["top_p"], seeds)
                items = [{"id": q["id"], "sample": k, "source": q["source"], "gold": q["answer"], "seed": s,
                          "backend": backend.name} for (q, k), s in zip(chunk, seeds)]
                graded = list(pool.map(lambda pair: _rule_grade(*pair, timeout_s, opened), zip(items, outs)))
                for r in graded:
                    fh.write(json.dumps(r) + "\n")
                fh.flush()
                records += graded
                generated += len(graded)
                n_tokens += sum(o.n_tokens for o in outs)
                n_correct += sum(r["correct"] for r in graded)
                elapsed = time.time() - t0
                rate = n_tokens / max(elapsed, 1e-9)
                left = (len(pending) - generated) / generated * elapsed
                log(f"{generated}/{len(pending)} samples  {elapsed:.0f} s  {rate:,.0f} tokens/s  "
                    f"eta {human_duration(left)}  correct {n_correct}/{generated}")
        del backend
        gc.collect()

    in_request = {(q["id"], k) for q, k in wanted}
    current = [r for r in records if (r["id"], r["sample"]) in in_request]
    if args.get("verifier"):
        by_id = {q["id"]: q for q in questions}
        if run_verifier(current, by_id, args, backend_name, _max_model_len(questions, protocol)):
            _write_records(gen_path, records)  # `current` holds the same dicts, judged in place

    kl = teacher_kl(args, questions, protocol, model, out) if args.get("teacher_kl") else None
    summary = summary_mod.summarize(current, config, len(wanted), elapsed_s=round(time.time() - started, 2))
    if kl is not None:
        summary["teacher_kl"] = kl
    summary["generated_this_run"] = generated
    summary["estimate"] = est
    _write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    from opd_patches.eval.plot import plot_summary

    plot_summary(summary, out / "scores.png")
    log(f"pass@1 = {summary['pass_at_1']:.4f} +/- {summary['se_clustered']:.4f} (question-clustered SE), "
        f"{summary['n_questions']} questions, {summary['n_samples']} samples, truncation {summary['truncation_rate']:.3f}, "
        f"{summary['n_unfinished_thought']} inside an unfinished thought"
        f"{'' if summary['complete'] else ' [INCOMPLETE]'}")
    log(f"wrote {gen_path}, {out / 'summary.json'}, {out / 'scores.png'}")
    return summary


def teacher_kl(args: dict, questions: list[dict], protocol: dict, model: str, out: Path) -> dict:
    """The teacher-KL of `model` (opd_patches/eval/teacher_kl.py), kept in <out>/teacher_kl.json for these
    settings: a rerun with the same ones reads it back."""
    from opd_patches.eval import teacher_kl as kl_mod

    teacher = str(Path(args["teacher_kl"]).resolve()) if Path(args["teacher_kl"]).exists() else args["teacher_kl"]
    settings = {"model": model, "teacher": teacher, "samples": int(args.get("kl_samples") or 1),
                "max_new_tokens": protocol["max_new_tokens"], "seed": protocol["seed"], "n_questions": len(questions)}
    path = out / KL_FILE
    try:
        old = json.loads(path.read_text())
        if old.get("settings") == settings:
            return old["result"]
    except (OSError, ValueError, KeyError):
        pass
    t0 = time.time()
    result = kl_mod.measure(model, teacher, questions, settings["samples"], settings["max_new_tokens"], settings["seed"])
    result["seconds"] = round(time.time() - t0, 1)
    result["teacher"] = teacher
    log(f"teacher-KL {result['teacher_kl']:.4f} +/- {result['se_clustered'] or 0:.4f} nats/token "
        f"({result['n_samples']} samples, {result['n_tokens']} tokens, teacher {teacher})")
    _write_atomic(path, json.dumps({"settings": settings, "result": result}, indent=2) + "\n")
    return result


def _max_model_len(questions: list[dict], protocol: dict) -> int:
    # vLLM needs a context length up front: the longest question with generous room for the template.
    # (characters bound the token count of ordinary text from above).
    return protocol["max_new_tokens"] + max(len(q["problem"]) for q in questions) + 512
