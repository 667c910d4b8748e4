"""The build of the known-answer task `addition` (addition.py): its tokenizer, models, data and marker.

Random weights prove plumbing only. Here both models are the same tiny Qwen2 (1.04M parameters: hidden
128, 4 layers, 4 heads of 32, tied embeddings) over the embedded default's tokenizer, trained in code on

    What is 12 + 34?            (one user turn, the project's prompt template: opd_patches/task/prompt.py)
    12 + 34 = 46. The answer is \\boxed{46}.

with a, b in 0..49: 2,500 pairs, split once (seeded) into 200 held-out questions (the evaluation suite
`addition`), 100 validation prompts and 2,200 training prompts; the three sets are disjoint. One
supervised run (AdamW, warm-up then cosine decay) on the training pairs gives both models: the teacher
is its end, the student an early snapshot that already writes the format but mostly gets the sum wrong.
Which snapshot is measured, not fixed: the pass@1 of an early snapshot sits on the steep part of the
learning curve, where float arithmetic (thread count, machine) moves it (docs/learning.md). The run
keeps the snapshots at PARAMS["sft"]["student_steps"] and the student is the latest whose held-out
pass@1 is at most STUDENT_TARGET (searched from student_steps' middle: two to four evaluations);
its step goes into the marker. Both are then evaluated by the project's own evaluation
(opd_patches.eval: rule grader, question-clustered SE) on the 200 held-out questions at the recipes'
sampling temperature 1.0; the figures go into the marker (`pass_at_1`) and the build fails when the
teacher is below TEACHER_MIN or the student above STUDENT_MAX, so a machine whose arithmetic drifts
the training elsewhere says so instead of handing out a task that proves nothing.

Output under `--out DIR` (the embedded default's layout, so run.sh treats both alike):
    tokenizer/, student/, teacher/, data/{train,val}.parquet, eval/{student,teacher}/ (summary.json,
    generations.jsonl), .complete (marker, written last; a matching marker means "skip rebuild")

    python -m opd_patches.embedded --task addition --out .cache/addition     (run.sh: EMBEDDED=addition)
"""

from __future__ import annotations

import math
import random
import shutil
import time
from pathlib import Path

from opd_patches.embedded.addition import (NAME, PARAMS, STUDENT_MAX, STUDENT_TARGET, SUITE, TEACHER_MIN, problem,
                                           solution, split)
from opd_patches.embedded.build import build_set, model_config, save_model, _save_tokenizer, _train_tokenizer

EVAL_BATCH = 100  # prompts per generate call in the build's evaluation (tiny model: one or two calls)


def _write_data(path: Path, parts: dict) -> None:
    import pandas as pd

    from opd_patches.task import prompt

    for name, pairs in (("train", parts["train"]), ("val", parts["val"])):
        rows = [{"data_source": PARAMS["data_source"], "prompt": prompt.messages(problem(a, b)), "ability": "math",
                 "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                 "extra_info": {"split": name, "index": i, "question": problem(a, b), "answer": str(a + b)}}
                for i, (a, b) in enumerate(pairs)]
        pd.DataFrame(rows).to_parquet(path / f"{name}.parquet", index=False)


def _examples(tokenizer, pairs) -> list[tuple[list[int], list[int]]]:
    from opd_patches.task import prompt

    out = []
    for a, b in pairs:
        ids = tokenizer(prompt.render(tokenizer, problem(a, b)), add_special_tokens=False).input_ids
        target = tokenizer(solution(a, b), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        out.append((ids, target))
    return out


def _batch(torch, examples, pad_id: int):
    """Right-padded (input_ids, attention_mask, labels): the loss covers the response and its EOS only."""
    width = max(len(p) + len(t) for p, t in examples)
    ids = torch.full((len(examples), width), pad_id)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100)
    for row, (p, t) in enumerate(examples):
        seq = p + t
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        labels[row, len(p) : len(seq)] = torch.tensor(t)
    return ids, mask, labels


def _lr_scale(step: int, s: dict) -> float:
    if step <= s["warmup"]:
        return step / s["warmup"]
    cos = 0.5 * (1 + math.cos(math.pi * (step - s["warmup"]) / (s["steps"] - s["warmup"])))
    return s["min_lr_ratio"] + (1 - s["min_lr_ratio"]) * cos


def _train(tokenizer, pairs, tmp: Path) -> None:
    """The supervised run: candidates/<step>/ saved at each of student_steps, teacher/ at the end."""
    import torch
    from transformers import Qwen2ForCausalLM

    s = PARAMS["sft"]
    examples = _examples(tokenizer, pairs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s["seed"])
        model = Qwen2ForCausalLM(model_config(tokenizer, PARAMS["model"])).to(torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], weight_decay=0.0)
        rng, order, started = random.Random(s["seed"]), [], time.time()
        model.train()
        for step in range(1, s["steps"] + 1):
            if len(order) < s["batch"]:  # epochs of a fixed shuffled order; the short remainder is dropped
                order = list(range(len(examples)))
                rng.shuffle(order)
            idx, order = order[: s["batch"]], order[s["batch"]:]
            ids, mask, labels = _batch(torch, [examples[i] for i in idx], tokenizer.pad_token_id)
            for group in opt.param_groups:
                group["lr"] = s["lr"] * _lr_scale(step, s)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 100 == 0 or step == s["steps"]:
                print(f"[{NAME}] supervised step {step}/{s['steps']}: loss {loss.item():.4f} "
                      f"({time.time() - started:.0f} s)", flush=True)
            if step in s["student_steps"]:
                save_model(model, tokenizer, tmp / "candidates" / str(step))
        save_model(model, tokenizer, tmp / "teacher")


def evaluate(model: Path, out: Path) -> dict:
    """The project's evaluation of `model` on the held-out suite (hf backend, this process)."""
    from opd_patches.eval.harness import run

    return run({"model": str(model), "suite": SUITE, "out": str(out), "backend": "hf", "batch_size": EVAL_BATCH})


def _choose_student(tmp: Path) -> tuple[int, dict]:
    """Move the latest candidate with held-out pass@1 <= STUDENT_TARGET to student/ (its evaluation to
    eval/student/); return its step and evaluation summary.

    pass@1 rises with the step, so the search walks from the middle candidate up while the next one
    stays at or below the target, or down until one does. The earliest candidate is taken when none does
    (the STUDENT_MAX check in _write then decides).
    """
    steps = PARAMS["sft"]["student_steps"]
    summaries: dict[int, dict] = {}

    def score(i: int) -> float:
        step = steps[i]
        if step not in summaries:
            summaries[step] = evaluate(tmp / "candidates" / str(step), tmp / "candidates-eval" / str(step))
            print(f"[{NAME}] student candidate at step {step}: held-out pass@1 "
                  f"{summaries[step]['pass_at_1']:.3f}", flush=True)
        return summaries[step]["pass_at_1"]

    i = len(steps) // 2
    if score(i) <= STUDENT_TARGET:
        while i + 1 < len(steps) and score(i + 1) <= STUDENT_TARGET:
            i += 1
    else:
        while i > 0 and score(i) > STUDENT_TARGET:
            i -= 1
    (tmp / "candidates" / str(steps[i])).rename(tmp / "student")
    (tmp / "eval").mkdir()
    (tmp / "candidates-eval" / str(steps[i])).rename(tmp / "eval" / "student")  # evaluated once, kept
    shutil.rmtree(tmp / "candidates")
    shutil.rmtree(tmp / "candidates-eval")
    return steps[i], summaries[steps[i]]


def _write(tmp: Path) -> dict:
    parts = split()
    tokenizer = _train_tokenizer()
    _save_tokenizer(tokenizer, tmp / "tokenizer")
    (tmp / "data").mkdir()
    _write_data(tmp / "data", parts)
    _train(tokenizer, parts["train"], tmp)
    student_step, student = _choose_student(tmp)
    figures = {}
    for who, summary in (("student", student), ("teacher", evaluate(tmp / "teacher", tmp / "eval" / "teacher"))):
        figures[who] = {"pass_at_1": summary["pass_at_1"], "se_clustered": summary["se_clustered"],
                        "n_questions": summary["n_questions"], "n_samples": summary["n_samples"]}
        print(f"[{NAME}] {who}: held-out pass@1 {summary['pass_at_1']:.3f} +/- {summary['se_clustered']:.3f}", flush=True)
    if figures["teacher"]["pass_at_1"] < TEACHER_MIN or figures["student"]["pass_at_1"] > STUDENT_MAX:
        raise RuntimeError(
            f"{NAME}: the build's models do not make a known-answer task (teacher pass@1 "
            f"{figures['teacher']['pass_at_1']:.3f}, needs >= {TEACHER_MIN}; student {figures['student']['pass_at_1']:.3f}, "
            f"needs <= {STUDENT_MAX}). The supervised run took another course on this machine: report it with "
            f"the log, and change PARAMS['sft'] in opd_patches/embedded/addition.py")
    return {"vocab_size": len(tokenizer), "pass_at_1": figures, "suite": SUITE, "student_step": student_step,
            "split": {k: len(v) for k, v in parts.items()}, "_extra_assets": ["eval"]}


def build(out: Path) -> dict[str, Path]:
    """Build (or reuse) the task's assets under `out`; return their paths."""
    return build_set(out, PARAMS, _write, label=NAME)


__all__ = ["build", "evaluate"]
