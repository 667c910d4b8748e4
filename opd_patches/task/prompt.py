"""The one prompt template, shared by training-data preparation and evaluation.

A problem becomes ONE user message, the problem text then the instruction on its own line::

    [{"role": "user", "content": "<problem>\\nPlease reason step by step, and put your final answer within \\\\boxed{}."}]

No system prompt (DeepSeek's advice for R1-Distill models: every instruction in the user turn). The
model's chat template is applied by whoever tokenizes: VERL's dataset for training (it reads the
`prompt` messages from the parquet), `render()` for evaluation. So a prepared parquet and an
evaluation run see the same text for the same problem, and the grader (`opd_patches.task.grader`)
reads the `\\boxed{}` the instruction asks for.

Imports only the standard library (data preparation and the grader worker stay light).
"""

from __future__ import annotations

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def user_content(problem: str) -> str:
    """The user turn for `problem` (surrounding whitespace stripped)."""
    problem = str(problem).strip()
    if not problem:
        raise ValueError("empty problem text: every row needs a problem statement")
    return f"{problem}\n{INSTRUCTION}"


def messages(problem: str) -> list[dict]:
    """Chat messages for `problem`, as stored in the parquet `prompt` column."""
    return [{"role": "user", "content": user_content(problem)}]


def render(tokenizer, problem: str) -> str:
    """The generation prompt text: `messages(problem)` inside the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer of {getattr(tokenizer, 'name_or_path', '?')} has no chat_template; evaluation "
            "uses the model's chat template, as training does (add one to tokenizer_config.json)"
        )
    return tokenizer.apply_chat_template(messages(problem), tokenize=False, add_generation_prompt=True)


def opens_thought(tokenizer) -> bool:
    """Whether the tokenizer's chat template ends the generation prompt inside a thought (R1-Distill's
    ends it with `<think>\\n`; ChatML's does not): the fact the grader needs to tell an unfinished
    thought (`opd_patches.task.grader.unfinished_thought`), derived from the template itself."""
    from opd_patches.task.grader import prompt_opens_thought

    return prompt_opens_thought(render(tokenizer, "What is 1 + 1?"))
