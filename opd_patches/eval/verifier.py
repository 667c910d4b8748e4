"""Optional model-verifier fallback: a judge model asked only when the rule grader cannot decide.

The rule grader (`opd_patches.task.grader.grade`) decides almost every sample; it cannot when math-verify
fails to parse the answer or the gold (`parse_error`), times out or errors (`GradeResult.decided` is
False). With `--verifier MODEL` (off by default), evaluation sends exactly those samples to a judge
model in the style of CompassVerifier (opencompass/CompassVerifier-3B/7B): one user turn holding the
question, the gold answer and the EXTRACTED answer, asking for one letter, A = correct, B = incorrect,
C = invalid. The judge is served by the same backend as the evaluated model (hf or vllm), greedy,
`max_new_tokens` 64 by default, after the evaluated model's generation is finished (one model in
memory at a time).

`parse_verdict` reads the judge's reply (after its last `</think>`, if any): a `\\boxed{A|B|C}`, else a
reply starting with the letter, else the first of the words CORRECT / INCORRECT / INVALID. Anything
else is unreadable (None): the sample keeps the rule grader's result (wrong), and the record says why.

`--verifier-prompt FILE` replaces the prompt: a text with `{question}`, `{gold}` (or `{gold_answer}`)
and `{answer}` (or `{llm_response}`), replaced literally, so a judge model's own published prompt can
be used as it is.
"""

from __future__ import annotations

import re
from pathlib import Path

PROMPT = """You are grading the final answer of a math solution against a reference answer.
Rules:
1. The reference answer is correct and the question is valid; do not solve the question again.
2. Judge only whether the candidate's final answer means the same as the reference answer; ignore formatting such as \\boxed{}, units written out, or equivalent mathematical forms.
3. If the candidate's answer is cut off, garbled or not an answer to the question, it is invalid.
Reply with one letter and nothing else:
A: CORRECT
B: INCORRECT
C: INVALID

<Question>
{question}
</Question>
<Reference answer>
{gold}
</Reference answer>
<Candidate answer>
{answer}
</Candidate answer>
Judgement:"""

VERDICTS = {"A": "correct", "B": "incorrect", "C": "invalid"}
_BOXED_RE = re.compile(r"\\boxed\{\s*([ABC])\s*\}")
_LEADING_RE = re.compile(r"^\W*([ABC])\b")
_WORD_RE = re.compile(r"\b(INCORRECT|CORRECT|INVALID)\b", re.IGNORECASE)


# Placeholder spellings accepted in a prompt file: ours, and CompassVerifier's own.
PLACEHOLDERS = {"question": ("{question}",), "gold": ("{gold}", "{gold_answer}"), "answer": ("{answer}", "{llm_response}")}


def build_prompt(question: str, gold: str, answer: str, template: str = PROMPT) -> str:
    """`template` with its placeholders replaced (plain replacement: other braces stay as written)."""
    values = {"question": question, "gold": gold, "answer": answer}
    for key, spellings in PLACEHOLDERS.items():
        for spelling in spellings:
            template = template.replace(spelling, values[key])
    return template


def parse_verdict(text: str) -> str | None:
    """"correct" | "incorrect" | "invalid" | None (unreadable) from a judge's reply."""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    text = text.strip()
    m = _BOXED_RE.search(text) or _LEADING_RE.match(text)
    if m:
        return VERDICTS[m.group(1)]
    m = _WORD_RE.search(text)
    return m.group(1).lower() if m else None


class Verifier:
    """A judge model behind an evaluation backend (`opd_patches.eval.backends`)."""

    def __init__(self, backend, model: str, max_new_tokens: int = 64, prompt_file: str | None = None):
        self.backend, self.model, self.max_new_tokens = backend, model, max_new_tokens
        self.template = Path(prompt_file).read_text() if prompt_file else PROMPT
        for spellings in PLACEHOLDERS.values():
            if not any(sp in self.template for sp in spellings):
                raise ValueError(f"verifier prompt {prompt_file}: it must contain {' or '.join(spellings)}")

    def _render(self, text: str) -> str:
        tok = self.backend.tokenizer
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return text

    def judge(self, items: list[tuple[str, str, str]]) -> list[tuple[str | None, str]]:
        """[(verdict or None, the judge's raw reply)] for [(question, gold, extracted answer)]."""
        if not items:
            return []
        prompts = [self._render(build_prompt(q, g, a, self.template)) for q, g, a in items]
        outs = self.backend.generate(prompts, self.max_new_tokens, 0.0, 1.0, [0] * len(prompts))
        return [(parse_verdict(o.text), o.text) for o in outs]


def apply_verdict(record: dict, verdict: str | None, raw: str, model: str) -> dict:
    """Record a judge's reply on a rule-undecided sample (in place): a readable verdict decides
    (`grader` "verifier", the rule grader's outcome kept under `rule`); an unreadable one leaves the
    rule result (wrong) and says so in `reason`. The reply itself is kept under `verifier`."""
    record["verifier"] = {"model": model, "verdict": verdict, "output": raw[:500]}
    if verdict is None:
        record["reason"] += "; verifier reply unreadable, rule result kept"
        return record
    record["rule"] = {"decided_by": record["decided_by"], "reason": record["reason"]}
    record.update(grader="verifier", decided_by="verifier", correct=verdict == "correct",
                  reason=f"rule grader undecided ({record['rule']['decided_by']}); judge said {verdict}")
    return record
