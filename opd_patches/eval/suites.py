"""Evaluation suites: a protocol file (what to sample) plus the question files it names.

A protocol is a YAML file in `opd_patches/eval/protocols/` (or any path given as the suite):

    name: math500_pass_at_1
    files: [math500.jsonl]   # looked up in the evaluation data folder
    samples: 4               # per question
    max_new_tokens: 12288
    seed: 42
    temperature: 0.6
    top_p: 0.95

Short names: `math500` = math500_pass_at_1, `aime` = aime24_25_at32.

A protocol may generate its questions instead (`generate: <generator>`, `questions: N`,
`question_seed: S`, `files: []`): `embedded` (protocols/embedded.yaml) makes N arithmetic word
problems with integer gold answers as the embedded training prompts are made (`opd_patches.embedded`),
so a smoke needs no data files; `addition` (protocols/addition.yaml) is the known-answer task's 200
held-out questions (`opd_patches.embedded.addition`), at the recipes' sampling temperature 1.0.

`question_offset: K` (default 0) skips the first K questions (generated or read), so that two protocols
can split one set: `addition_proxy` (its first 100 held-out questions) picks a checkpoint and
`addition_final` (the other 100) scores it, on questions the choice never saw (`make select`).

Question files are JSONL rows `{"id", "problem", "answer"}` (ids unique within the suite; a row without
an id gets `<file stem>-<line>`). The evaluation data folder is `--data-dir`, else `$OPD_EVAL_DATA`,
else `~/data/opd-eval` (DEFAULT_DATA_DIR): the user fills it with MATH-500 / AIME 2024 / AIME 2025 in
that form (see docs/evaluation.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

PROTOCOLS = Path(__file__).resolve().parent / "protocols"
ALIASES = {"math500": "math500_pass_at_1", "aime": "aime24_25_at32"}
DEFAULT_DATA_DIR = Path.home() / "data" / "opd-eval"
REQUIRED = {"name": str, "files": list, "samples": int, "max_new_tokens": int, "seed": int,
            "temperature": (int, float), "top_p": (int, float)}


def default_data_dir() -> Path:
    return Path(os.environ.get("OPD_EVAL_DATA") or DEFAULT_DATA_DIR).expanduser()


def suite_names() -> list[str]:
    return sorted(p.stem for p in PROTOCOLS.glob("*.yaml")) + sorted(ALIASES)


def load_protocol(suite: str) -> dict:
    """The protocol of `suite` (a name, an alias or a YAML path), validated."""
    path = Path(suite)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = PROTOCOLS / f"{ALIASES.get(suite, suite)}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown suite {suite!r}: known {', '.join(suite_names())}, or a protocol .yaml path")
    protocol = yaml.safe_load(path.read_text()) or {}
    for key, kind in REQUIRED.items():
        if not isinstance(protocol.get(key), kind):
            raise ValueError(f"protocol {path}: key {key!r} missing or not {kind}")
    return {**protocol, "protocol_file": str(path)}


def embedded_questions(n: int, seed: int) -> list[dict]:
    """`n` distinct arithmetic word problems (`opd_patches.embedded`'s generator), ids `embedded-<i>`."""
    import random

    from opd_patches.embedded.build import _problem

    rng, found = random.Random(seed), {}
    while len(found) < n:
        problem, answer = _problem(rng)
        found.setdefault(problem, answer)
    return [{"id": f"embedded-{i}", "problem": q, "answer": str(a), "source": "embedded"}
            for i, (q, a) in enumerate(found.items())]


def addition_questions(n: int, seed: int) -> list[dict]:
    """The known-answer task's held-out questions (opd_patches/embedded/addition.py)."""
    from opd_patches.embedded.addition import questions

    return questions(n, seed)


GENERATORS = {"embedded": embedded_questions, "addition": addition_questions}


def load_questions(protocol: dict, data_dir: Path, limit: int | None = None) -> list[dict]:
    """[{"id", "problem", "answer", "source"}] of the suite's files, in file order (or generated, for a
    protocol with `generate`), after the first `question_offset`; first `limit` only."""
    offset = protocol.get("question_offset", 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"protocol {protocol['protocol_file']}: key 'question_offset' must be a non-negative integer, "
                         f"got {offset!r}")
    if protocol.get("generate") is not None:
        make = GENERATORS.get(protocol["generate"])
        if make is None:
            raise ValueError(f"protocol {protocol['protocol_file']}: generate {protocol['generate']!r} is not one of "
                             f"{', '.join(GENERATORS)}")
        n = protocol.get("questions")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"protocol {protocol['protocol_file']}: key 'questions' (how many to generate) must be a positive integer")
        count = min(n, limit or n)
        made = make(offset + count, int(protocol.get("question_seed", 0)))[offset:]
        if len(made) < count:  # a fixed split (addition) has only so many
            raise ValueError(f"protocol {protocol['protocol_file']}: questions {offset + 1}..{offset + count} asked, "
                             f"generator {protocol['generate']!r} has {offset + len(made)}")
        return made
    data_dir = Path(data_dir).expanduser()
    questions, seen = [], set()
    for name in protocol["files"]:
        path = data_dir / name
        if not path.is_file():
            raise FileNotFoundError(
                f"suite {protocol['name']}: {path} is missing. Put {{id, problem, answer}} JSONL files "
                f"({', '.join(protocol['files'])}) in {data_dir}, or point --data-dir / OPD_EVAL_DATA at them"
            )
        from opd_patches.checks.data import check_eval_jsonl

        for i, row in enumerate(check_eval_jsonl(path)):  # every line a JSON object with problem and answer
            qid = str(row.get("id", f"{path.stem}-{i}"))
            if qid in seen:
                raise ValueError(f"{path}: row {i + 1}: question id {qid!r} appears twice in suite {protocol['name']}")
            seen.add(qid)
            questions.append({"id": qid, "problem": row["problem"], "answer": str(row["answer"]), "source": path.stem})
    questions = questions[offset:]
    return questions[:limit] if limit else questions
