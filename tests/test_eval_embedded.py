"""The built-in `embedded` suite and R1's thinking convention, through the real command line
(`opd_patches.eval.cli.main`, hf backend, CPU) on the tiny embedded student.

- `--suite embedded` needs no files: arithmetic questions generated in code, graded, summary and plot written.
- A chat template that ends the generation prompt with `<think>` (R1-Distill's convention; here the
  embedded ChatML template with that one change) makes every response that never writes `</think>` an
  unfinished thought: scored 0 and counted in the summary beside truncation. The ChatML model: none.
"""

import json
import shutil

import pytest

from opd_patches.task import prompt
from opd_patches.eval import cli, suites

PNG = b"\x89PNG\r\n\x1a\n"
ARGS = ["--suite", "embedded", "--limit", "4", "--samples", "1", "--max-new-tokens", "8", "--backend", "hf"]


def r1_style(student, out):
    """A copy of `student` whose chat template opens a thought in the generation prompt, as R1-Distill's does."""
    from transformers import AutoTokenizer

    shutil.copytree(student, out)
    tok = AutoTokenizer.from_pretrained(out)
    chatml_prompt = "{{- '<|im_start|>assistant\\n' }}"
    assert chatml_prompt in tok.chat_template
    tok.chat_template = tok.chat_template.replace(chatml_prompt, "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    tok.save_pretrained(out)
    return out


def test_embedded_suite_is_generated_in_code():
    protocol = suites.load_protocol("embedded")
    assert (protocol["files"], protocol["questions"], protocol["max_new_tokens"]) == ([], 16, 1024)
    questions = suites.load_questions(protocol, "/no/such/folder")
    assert len(questions) == 16 and len({q["problem"] for q in questions}) == 16
    assert all(q["answer"].isdigit() for q in questions)
    assert suites.load_questions(protocol, "/no/such/folder", limit=4) == questions[:4]  # a prefix, same seed


@pytest.mark.parametrize("template", ["chatml", "r1"])
def test_cli_on_the_embedded_suite(embedded, tmp_path, template):
    from transformers import AutoTokenizer

    model = embedded["student"] if template == "chatml" else r1_style(embedded["student"], tmp_path / "r1")
    opens = template == "r1"
    assert prompt.opens_thought(AutoTokenizer.from_pretrained(model)) is opens
    out = tmp_path / "out"
    assert cli.main(["--model", str(model), "--out", str(out), *ARGS]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["suite"], summary["n_questions"], summary["n_samples"], summary["complete"]) == ("embedded", 4, 4, True)
    assert json.loads((out / "eval_config.json").read_text())["prompt_opens_thought"] is opens
    records = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert all("</think>" not in r["response"] for r in records)  # 8 tokens of a random model
    assert [r["unfinished_thought"] for r in records] == [opens] * 4
    assert summary["n_unfinished_thought"] == (4 if opens else 0)
    if opens:
        assert all((r["correct"], r["decided_by"]) == (False, "no_answer") for r in records)
    assert (out / "scores.png").read_bytes()[:8] == PNG
