"""The known-answer task `addition` (its questions, answers and split): a teacher that adds two-digit
numbers, a student that cannot yet. Pure: no model, no evaluation. The models and data are built by
addition_build.py (`python -m opd_patches.embedded --task addition --out .cache/addition`; run.sh:
EMBEDDED=addition); the evaluation suite `addition` (opd_patches/eval/protocols/addition.yaml) asks
`questions` for its held-out questions.

    What is 12 + 34?            (one user turn, the project's prompt template: opd_patches/task/prompt.py)
    12 + 34 = 46. The answer is \\boxed{46}.

with a, b in 0..49: 2,500 pairs, split once (seeded) into 200 held-out questions, 100 validation prompts
and 2,200 training prompts; the three sets are disjoint. PARAMS is the whole build's recipe (its hash is
the build's identity, so a change here rebuilds the task).
"""

from __future__ import annotations

import random

NAME = "addition"
BUILD_VERSION = 1
PARAMS = {
    "version": BUILD_VERSION,
    "task": NAME,
    "operands": {"max": 49, "split_seed": 0, "n_test": 200, "n_val": 100},
    # head_dim 32: a size every attention kernel takes (vLLM's included), unlike the default's 16
    "model": {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 2048, "vocab_multiple": 64},
    "sft": {"seed": 0, "batch": 64, "lr": 2e-3, "warmup": 50, "steps": 500, "min_lr_ratio": 0.1,
            "student_steps": [150, 175, 200, 225, 250, 275, 300]},
    "data_source": "opd/addition",
}
TEACHER_MIN, STUDENT_MAX = 0.8, 0.2
STUDENT_TARGET = 0.18  # the strongest student taken: below STUDENT_MAX with room for another machine's drift
SUITE = NAME  # opd_patches/eval/protocols/addition.yaml


def problem(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def solution(a: int, b: int) -> str:
    return f"{a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}."


def split() -> dict[str, list[tuple[int, int]]]:
    """{"test", "val", "train"}: disjoint lists of (a, b), the same on every machine."""
    o = PARAMS["operands"]
    pairs = [(a, b) for a in range(o["max"] + 1) for b in range(o["max"] + 1)]
    random.Random(o["split_seed"]).shuffle(pairs)
    n_test, n_val = o["n_test"], o["n_val"]
    return {"test": pairs[:n_test], "val": pairs[n_test:n_test + n_val], "train": pairs[n_test + n_val:]}


def questions(n: int, seed: int = 0) -> list[dict]:
    """The first `n` held-out questions (the `addition` suite's generator; `seed` is unused: the split is fixed)."""
    return [{"id": f"{NAME}-{a}+{b}", "problem": problem(a, b), "answer": str(a + b), "source": NAME}
            for a, b in split()["test"][:n]]


__all__ = ["NAME", "PARAMS", "SUITE", "STUDENT_MAX", "STUDENT_TARGET", "TEACHER_MIN", "problem", "questions", "solution", "split"]
