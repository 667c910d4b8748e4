"""The grader and the reward function: real gold answers, equivalent forms, extraction rules, the
process-based timeout from worker threads, and VERL's own loading of the reward function.

Real problems come from tests/real_problems.py's folder (read in place, never copied into the repository).
"""

import asyncio
import json
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from opd_patches.task import grader, reward
from opd_patches.task.grader import grade
from real_problems import DATA, missing

REPO = Path(__file__).resolve().parents[1]
PATHOLOGICAL = "9^{9^{9^{9}}}"  # sympy tries to evaluate the tower and never finishes


def rows(name):
    path = DATA / f"{name}.jsonl"
    if not path.exists():
        pytest.skip(missing(path))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def warm():
    """Make sure a math-verify worker is running, so that timings measure grading, not its start."""
    assert grade("\\boxed{1/2}", "0.5").decided_by == "math_verify"


@pytest.fixture(scope="module", autouse=True)
def warm_worker():
    warm()


# --- real gold answers -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["math500", "aime24", "aime25"])
def test_every_gold_matches_itself(name):
    for row in rows(name):
        gold = row["answer"]
        boxed = f"Let me think. So the result is $\\boxed{{{gold}}}$."
        line = f"Some reasoning.\nAnswer: {gold}"
        for response in (boxed, line):
            result = grade(response, gold)
            assert result.correct, (row["id"], response, result)
        # the same without the string fast path: math-verify itself accepts every gold
        result = grade(boxed, gold, fast_path=False)
        assert result.correct and result.decided_by == "math_verify", (row["id"], result)


@pytest.mark.parametrize("name", ["aime24", "aime25"])
def test_aime_off_by_one_is_wrong(name):
    for row in rows(name):
        wrong = str(int(row["answer"]) + 1)
        for response in (f"\\boxed{{{wrong}}}", f"Answer: {wrong}"):
            result = grade(response, row["answer"])
            assert not result.correct and result.decided_by == "math_verify", (row["id"], result)
            assert result.extracted == wrong


def test_math500_other_answers_are_wrong():
    """Each gold against the next gold of MATH-500 (a different, valid expression), unless the two
    are the same answer (equal strings, or `x=5` after `5`)."""

    def value(s):
        return re.sub(r"^[a-z]=", "", grader._normalize(s))

    golds = [row["answer"] for row in rows("math500")]
    checked = 0
    for gold, other in zip(golds, golds[1:] + golds[:1]):
        if value(gold) == value(other):
            continue
        result = grade(f"\\boxed{{{other}}}", gold)
        assert not result.correct and result.decided_by == "math_verify", (gold, other, result)
        checked += 1
    assert checked > 450


# --- equivalent forms and extraction -----------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("\\frac{1}{2}", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("\\dfrac12", "\\frac{1}{2}"),
        ("\\tfrac{1}{2}", "1/2"),
        ("x=3", "3"),
        ("\\text{(B)}", "B"),
        ("B", "\\text{(B)}"),
        ("\\textbf{(C)}", "\\text{(C)}"),
        ("90", "90^\\circ"),
        ("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("\\{1-\\sqrt{5},1+\\sqrt{5},-2\\}", "\\{1\\pm\\sqrt{5},-2\\}"),
        ("[-2, 7]", "x \\in [-2,7]"),
    ],
)
def test_equivalent_forms(answer, gold):
    result = grade(f"... so the answer is $\\boxed{{{answer}}}$", gold)
    assert result.correct, result


@pytest.mark.parametrize(
    "response, extracted",
    [
        ("first \\boxed{3}, on reflection \\boxed{4}", "4"),  # the last box wins
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # nested braces
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped set braces are not grouping
        ("\\boxed{\\boxed{5}}", "5"),
        ("\\fbox{7}", "7"),
        ("so $\\boxed 7$.", "7"),
        ("\\boxed{3} and then, cut off: \\boxed{\\frac{1}{", "3"),  # an unfinished box is skipped
        ("\\boxed{5} was wrong.\nAnswer: 6", "5"),  # a box beats the Answer line
        ("Reasoning...\nAnswer: $\\frac{1}{2}$.", "\\frac{1}{2}"),
        ("**Answer:** 12", "12"),
        ("<think>maybe \\boxed{3}</think>\nThe answer is \\boxed{4}.", "4"),
    ],
)
def test_extraction(response, extracted):
    assert grader.extract_answer(response)[0] == extracted
    assert grade(response, extracted).correct


def test_last_box_decides_correctness():
    assert not grade("\\boxed{12} no wait \\boxed{13}", "12").correct
    assert grade("\\boxed{13} no wait \\boxed{12}", "12").correct


@pytest.mark.parametrize(
    "response",
    ["", "I could not solve it.", "\\boxed{}", "\\boxed{\\frac{1}{", "<think>it is \\boxed{4}</think> out of time"],
)
def test_no_answer(response):
    result = grade(response, "4")
    assert (result.correct, result.extracted, result.decided_by) == (False, None, "no_answer")


# --- R1's thinking convention ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, prompt_opened, unfinished",
    [
        ("so \\boxed{4}", False, False),  # a template without thoughts (ChatML): the whole text, as before
        ("so \\boxed{4}", True, True),  # R1's prompt opened the thought; cut at the cap before </think>
        ("maybe \\boxed{3}</think> so \\boxed{4}", True, False),  # R1's usual shape: answer after </think>
        ("<think>so \\boxed{4}", False, True),  # the response opened a thought itself and never closed it
        ("<think>hm</think> \\boxed{4}", False, False),
        ("<think>a</think> \\boxed{4} <think>again \\boxed{4}", True, True),  # re-opened, never closed
    ],
)
def test_unfinished_thought_has_no_final_answer(response, prompt_opened, unfinished):
    result = grade(response, "4", prompt_opened_thought=prompt_opened)
    assert grader.unfinished_thought(response, prompt_opened) is unfinished
    assert (result.unfinished_thought, result.correct) == (unfinished, not unfinished), result
    if unfinished:
        assert (result.extracted, result.decided_by) == (None, "no_answer") and "unfinished thought" in result.reason


def test_the_fact_comes_from_the_chat_template(embedded, tmp_path):
    """Reward and evaluation read whether the prompt opens a thought from the tokenizer's template
    (`prompt.opens_thought`); an R1-style template (ChatML + `<think>` after the assistant header) vs ChatML."""
    from transformers import AutoTokenizer

    from opd_patches.task import prompt

    chatml = AutoTokenizer.from_pretrained(embedded["tokenizer"])
    r1 = AutoTokenizer.from_pretrained(embedded["tokenizer"])
    r1.chat_template = chatml.chat_template.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    assert r1.chat_template != chatml.chat_template
    r1.save_pretrained(tmp_path / "r1")
    assert (prompt.opens_thought(chatml), prompt.opens_thought(r1)) == (False, True)
    cut = "Let me think. 2 + 2 = \\boxed{4}, or is it"  # no </think>: still thinking at the cap
    done = "2 + 2 = \\boxed{5}? no.</think>\nThe answer is \\boxed{4}."
    assert reward.compute_score("x", cut, "4", tokenizer=str(embedded["tokenizer"]))["score"] == 1.0
    assert reward.compute_score("x", cut, "4", tokenizer=str(tmp_path / "r1")) == {
        "score": 0.0, "acc": False, "pred": "", "unfinished_thought": True}
    assert reward.compute_score("x", done, "4", tokenizer=str(tmp_path / "r1"))["score"] == 1.0


def test_which_grader_decided():
    """Every result names the deciding step; parse errors are not verdicts (a verifier may be asked)."""
    cases = [("\\boxed{4}", "4", "string_match", True), ("\\boxed{0.5}", "\\frac{1}{2}", "math_verify", True),
             ("\\boxed{5}", "4", "math_verify", True), ("no answer here", "4", "no_answer", True),
             ("\\boxed{\\text{}}", "4", "parse_error", False)]
    for response, gold, decided_by, decided in cases:
        result = grade(response, gold)
        assert (result.decided_by, result.decided) == (decided_by, decided), (response, result)
        assert result.reason
    assert not grade("\\boxed{\\text{}}", "4").correct  # the training reward is unchanged: wrong


# --- timeouts outside the main thread ---------------------------------------------------------------


def _grade_in_thread(response, gold, timeout_s):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", grade(response, gold, timeout_s=timeout_s)))
    thread.start()
    thread.join(timeout_s + 30)  # an upper bound only: the computations below never end on their own
    assert not thread.is_alive(), "grade() hung"
    return out["result"]


def worker_pids() -> set[int]:
    """This process's running math-verify workers (`python -c BOOTSTRAP .../grader.py`)."""
    script = os.path.abspath(grader.__file__).encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")  # empty once it has exited (a zombie)
            status = (entry / "status").read_text()
        except OSError:  # not a process, or gone meanwhile
            continue
        if script in argv and f"\nPPid:\t{os.getpid()}\n" in status:
            pids.add(int(entry.name))
    return pids


def killed_by(call):
    """call()'s result and the workers that were running before it and are gone after it."""
    before = worker_pids()
    assert before, "no worker running: warm() first"
    result = call()
    return result, before - worker_pids()


def test_timeout_in_a_worker_thread():
    warm()
    result, killed = killed_by(lambda: _grade_in_thread(f"\\boxed{{{PATHOLOGICAL}}}", "1", timeout_s=1.0))
    assert result.decided_by == "timeout" and not result.correct, result
    assert result.extracted == PATHOLOGICAL
    assert len(killed) == 1  # the busy worker was killed at the timeout, not waited for
    # the killed worker is replaced: grading goes on
    assert grade("\\boxed{\\frac{2}{4}}", "0.5").correct


def test_timeout_under_asyncio_to_thread():
    async def main():
        return await asyncio.wait_for(
            asyncio.to_thread(grade, f"\\boxed{{{PATHOLOGICAL}}}", "2", timeout_s=0.5), timeout=30
        )

    warm()
    result, killed = killed_by(lambda: asyncio.run(main()))
    assert result.decided_by == "timeout" and len(killed) == 1


def test_timeout_with_a_slow_verifier(monkeypatch):
    """A monkeypatched verifier that sleeps (in the worker process) for answers marked 'slow'."""
    slow_bootstrap = grader._BOOTSTRAP.replace(
        "mod._serve()\n",
        "import time\n"
        "real = mod._math_verify\n"
        "mod._math_verify = lambda g, a: time.sleep(600) if a == 'slow' else real(g, a)\n"
        "mod._serve()\n",
    )
    monkeypatch.setattr(grader, "_BOOTSTRAP", slow_bootstrap)
    monkeypatch.setattr(grader, "_pool", None)  # a fresh pool that starts the patched worker
    try:
        warm()
        result, killed = killed_by(lambda: _grade_in_thread("\\boxed{slow}", "1", timeout_s=0.5))
        assert result.decided_by == "timeout" and len(killed) == 1, (result, killed)
        assert grade("\\boxed{1.0}", "1").correct  # respawned, patched, still grading
    finally:
        grader._get_pool().close()


def test_concurrent_calls_from_threads():
    cases = [(f"\\boxed{{\\frac{{{2 * k}}}{{2}}}}", str(k), True) for k in range(1, 9)]
    cases += [(f"\\boxed{{{k + 1}}}", str(k), False) for k in range(1, 9)]
    results = [None] * len(cases)

    def work(i):
        results[i] = grade(cases[i][0], cases[i][1])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.correct for r in results] == [c[2] for c in cases]


# --- the reward function and VERL's loader -----------------------------------------------------------


@pytest.mark.parametrize("data_source", ["my/unknown_source", "math_dapo", "lighteval/MATH", "aime24"])
def test_compute_score_any_data_source(data_source):
    right = reward.compute_score(data_source, "... \\boxed{\\frac{3}{2}}", "1.5", extra_info={"index": 0})
    assert right == {"score": 1.0, "acc": True, "pred": "\\frac{3}{2}", "unfinished_thought": False}
    wrong = reward.compute_score(data_source, "Answer: 7", "8")
    assert wrong == {"score": 0.0, "acc": False, "pred": "7", "unfinished_thought": False}
    none = reward.compute_score(data_source, "no idea", "8")
    assert none == {"score": 0.0, "acc": False, "pred": "", "unfinished_thought": False}


RECOMMENDED = ["reward.custom_reward_function.path=pkg://opd_patches.task.reward",
               "reward.custom_reward_function.name=compute_score"]


def compose_k1(model, *overrides):
    from composed import compose_recipe

    return compose_recipe("k1", f"actor_rollout_ref.model.path={model}", *overrides)


@pytest.mark.parametrize(
    "overrides",
    [RECOMMENDED, [f"reward.custom_reward_function.path={REPO / 'opd_patches' / 'task' / 'reward.py'}"]],
    ids=["pkg", "file"],
)
def test_verl_loader_accepts_the_recipe_keys(overrides, embedded):
    from verl.trainer.ppo.reward import get_custom_reward_fn

    config = compose_k1(embedded["student"], *overrides)
    assert config.reward.custom_reward_function.reward_kwargs.tokenizer == str(embedded["student"])
    fn = get_custom_reward_fn(config)
    assert fn is not None
    # called as VERL's naive reward manager calls it
    out = fn(data_source="my/unknown_source", solution_str="\\boxed{4}", ground_truth="4", extra_info={})
    assert out["score"] == 1.0


def test_verl_naive_reward_manager_end_to_end(embedded):
    """VERL's reward-loop path: load_reward_manager + NaiveRewardManager.run_single on a DataProto
    (it calls the function in an executor thread, where signal-based timeouts would fail)."""
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    class CharTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(int(i)) for i in ids if int(i) != 0)

    def sample(text, gold, data_source, width=48):
        ids = [ord(c) for c in text] + [0] * (width - len(text))
        mask = [1] * len(text) + [0] * (width - len(text))
        return DataProto.from_dict(
            tensors={"prompts": torch.ones(1, 4, dtype=torch.long),
                     "responses": torch.tensor([ids]),
                     "attention_mask": torch.tensor([[1] * 4 + mask])},
            non_tensors={"data_source": np.array([data_source], dtype=object),
                         "reward_model": np.array([{"ground_truth": gold, "style": "rule"}], dtype=object),
                         "extra_info": np.array([{"index": 0}], dtype=object)},
        )

    # reward_kwargs reach the function: a short timeout for the hung sample
    config = compose_k1(embedded["student"], *RECOMMENDED, "+reward.custom_reward_function.reward_kwargs.timeout_s=1.0")

    async def main():
        manager = load_reward_manager(config, CharTokenizer())
        return [
            await manager.run_single(sample("so \\boxed{\\dfrac{1}{2}}", "0.5", "my/unknown_source")),
            await manager.run_single(sample(f"\\boxed{{{PATHOLOGICAL}}}", "3", "math_dapo")),
        ]

    right, hung = asyncio.run(main())
    assert right["reward_score"] == 1.0 and right["reward_extra_info"]["pred"] == "\\dfrac{1}{2}"
    # the hung comparison is cut off after reward_kwargs.timeout_s and scores 0
    assert hung["reward_score"] == 0.0 and hung["reward_extra_info"]["acc"] is False
