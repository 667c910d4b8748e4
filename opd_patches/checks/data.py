"""Data files checked before a run starts: VERL's RL parquet, `make data` sources, evaluation JSONL.

VERL's RL parquet (what `data.train_files` / `data.val_files` name; `make data` writes it):

    prompt        a non-empty list of {"role": str, "content": str} chat messages (VERL renders them with
                  the student's chat template; a plain string is what a raw download holds)
    data_source   a string (the reward is looked up by it; this project's reward takes any)
    reward_model  a mapping with `ground_truth` (every recipe computes the correctness reward: the metric
                  critic/score/mean, and the loss term with distillation_loss.use_task_rewards=true)

`check_rl_parquet` reads the file with pyarrow, requires >= 1 row and these columns, checks every row of
files up to FULL_CHECK_ROWS rows (larger ones: the schema and the first FULL_CHECK_ROWS rows), and, given
the student's tokenizer and `data.max_prompt_length`, counts the prompts VERL's length filter will drop
(rendered with the chat template and tokenized as VERL does); none left is refused, some is reported.
Every error names the file, the row index and the column, what was found and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from opd_patches.checks import InputError

FULL_CHECK_ROWS = 200_000  # DAPO-Math-17k is checked whole in about a second
REQUIRED = ("prompt", "data_source", "reward_model")
MAKE_DATA = "make data SRC=<the raw file> (opd_patches/data/prepare.py converts DAPO-style or {problem, answer} rows)"


def _read_table(path: Path, key: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.exists():
        raise InputError(f"{key}={path}: no such file. Prepare the training data with {MAKE_DATA}.")
    if path.is_dir():
        raise InputError(f"{key}={path}: is a folder; name the .parquet file in it.")
    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{key}={path}: not a readable parquet file ({str(exc).splitlines()[0]}). VERL reads "
                         f"parquet; convert the file with {MAKE_DATA}.") from None


def _message_error(prompt) -> str | None:
    """Why `prompt` (one row's value) is no list of chat messages, or None."""
    if isinstance(prompt, str):
        return f"a plain string ({prompt[:60]!r}...), not a list of chat messages"
    if not isinstance(prompt, (list, tuple)):
        return f"a {type(prompt).__name__}, not a list of chat messages"
    if not prompt:
        return "an empty list (no message)"
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"message {j} is {m!r:.80}, not {{role, content}}"
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            return f"message {j} has role {type(m['role']).__name__} / content {type(m['content']).__name__}, not strings"
    if not any(m["content"].strip() for m in prompt):
        return "only empty message contents"
    return None


def check_rl_parquet(path, key: str, tokenizer=None, max_prompt_length: int | None = None,
                     template_kwargs: dict | None = None) -> dict:
    """Check one RL parquet file (see the module docstring); returns {"rows", "checked", "too_long"}."""
    path = Path(path).expanduser()
    table = _read_table(path, key)
    where = f"{key}={path}"
    if table.num_rows == 0:
        raise InputError(f"{where}: the file has no rows. Write it again with {MAKE_DATA}.")
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise InputError(f"{where}: no column {', '.join(missing)} (columns: {', '.join(table.column_names)}); VERL's RL "
                         f"schema is prompt (chat messages), data_source, reward_model.ground_truth. Convert it with "
                         f"{MAKE_DATA}.")
    n = min(table.num_rows, FULL_CHECK_ROWS)
    rows = table.slice(0, n).select(list(REQUIRED)).to_pylist()
    for i, row in enumerate(rows):
        why = _message_error(row["prompt"])
        if why:
            raise InputError(f"{where}: row {i}, column prompt: {why}. Each row's prompt must be a list of "
                             f"{{role, content}} messages; convert the file with {MAKE_DATA}.")
        if not isinstance(row["data_source"], str) or not row["data_source"]:
            raise InputError(f"{where}: row {i}, column data_source: {row['data_source']!r}, not a name. "
                             f"Write it again with {MAKE_DATA}.")
        rm = row["reward_model"]
        if not isinstance(rm, dict) or rm.get("ground_truth") in (None, ""):
            raise InputError(f"{where}: row {i}, column reward_model: {rm!r:.100} has no ground_truth (the gold answer "
                             f"the reward and the score metric read). Write it again with {MAKE_DATA}.")
    too_long = None
    if tokenizer is not None and max_prompt_length:
        too_long = _count_too_long([r["prompt"] for r in rows], tokenizer, max_prompt_length, template_kwargs or {})
        if too_long == n:
            raise InputError(f"{where}: all {n} prompts checked are longer than data.max_prompt_length="
                             f"{max_prompt_length} tokens after the chat template, and VERL drops those: nothing would "
                             f"remain. Raise data.max_prompt_length, or shorten the prompts.")
    return {"rows": table.num_rows, "checked": n, "too_long": too_long}


def _count_too_long(prompts: list, tokenizer, limit: int, template_kwargs: dict) -> int:
    """Prompts over `limit` tokens as VERL's filter measures them (chat template with the generation
    prompt, then tokenized without special tokens being added again)."""
    texts = [tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False, **template_kwargs)
             for p in prompts]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return sum(length > limit for length in lengths)


def check_eval_jsonl(path: Path) -> list[dict]:
    """An evaluation suite's JSONL file: every line a JSON object with `problem` and `answer`; its rows."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{path}:{i + 1}: not a JSON object ({exc}); each line is {{\"id\", \"problem\", "
                             "\"answer\"}.") from None
        if not isinstance(row, dict):
            raise InputError(f"{path}:{i + 1}: {type(row).__name__}, not a JSON object {{id, problem, answer}}.")
        missing = [k for k in ("problem", "answer") if row.get(k) in (None, "")]
        if missing:
            raise InputError(f"{path}:{i + 1}: no {' and no '.join(missing)} (rows are {{id, problem, answer}}); "
                             "fix or remove that line.")
        rows.append(row)
    if not rows:
        raise InputError(f"{path}: no rows (one {{id, problem, answer}} JSON object per line).")
    return rows
