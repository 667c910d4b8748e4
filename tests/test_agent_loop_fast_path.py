"""The colocated agent loop's two shortcuts (opd_patches/teacher/agent_loop.py): the rule-based reward computed
in the agent-loop worker's own process, and a client that talks to the one rollout server directly.

Each runs upstream's own code around it: the reward through upstream's `AgentLoopWorker._compute_score`
(which builds the reward input and calls `handle.compute_score.remote(data)`), the client through upstream's
`LLMServerClient.generate`. Expected values come from the project's grader on the decoded text, independently.
The guards at the end fail loudly when upstream changes the call shapes these rely on.
"""

import asyncio
import inspect

import pytest
from verl.experimental.agent_loop import AgentLoopOutput
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopWorker
from verl.workers.rollout import llm_server
from verl.workers.rollout.replica import TokenOutput

import composed
from opd_patches.task.grader import grade
from opd_patches.teacher.agent_loop import (
    ColocatedTeacherAgentLoopWorker,
    InProcessRewardWorker,
    SingleServerClient,
    rule_based_reward,
)


@pytest.fixture(scope="module")
def config(embedded):
    return composed.compose_recipe(
        "topk", "+device=cpu", f"actor_rollout_ref.model.path={embedded['student']}",
        f"distillation.teacher_models.teacher_model.model_path={embedded['teacher']}",
        f"reward.custom_reward_function.reward_kwargs.tokenizer={embedded['student']}")


def _worker(config):
    """The agent-loop worker's state that `_compute_score` reads, without Ray or its servers."""
    worker = object.__new__(ColocatedTeacherAgentLoopWorker)
    worker.config, worker.processor, worker.mm_processor_kwargs = config, None, None
    worker.reward_loop_worker_handles = [InProcessRewardWorker(config)]
    return worker


def _output(tokenizer, prompt: str, response: str) -> AgentLoopOutput:
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response_ids, response_mask=[1] * len(response_ids),
                           num_turns=2, metrics=AgentLoopMetrics())


@pytest.mark.parametrize("response", [r"2 + 3 = 5. The answer is \boxed{5}.", r"2 + 3 = 6. The answer is \boxed{6}.",
                                      "no answer at all"])
def test_in_process_reward_matches_the_grader(config, response):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    worker = _worker(config)
    output = _output(tokenizer, "What is 2 + 3?", response)
    kwargs = {"data_source": "addition", "reward_model": {"ground_truth": "5", "style": "rule"}, "extra_info": {},
              "raw_prompt": [{"role": "user", "content": "What is 2 + 3?"}]}
    asyncio.run(AgentLoopWorker._compute_score(worker, [output], kwargs=kwargs))  # upstream's method, unchanged
    expected = float(grade(tokenizer.decode(output.response_ids, skip_special_tokens=True), "5").correct)
    assert output.reward_score == expected
    assert output.extra_fields["reward_extra_info"]["acc"] == bool(expected)
    assert (expected == 1.0) == response.startswith("2 + 3 = 5")


def test_only_a_rule_based_reward_moves_in_process(config):
    assert rule_based_reward(config)
    from omegaconf import open_dict

    with_rm = config.copy()
    with open_dict(with_rm):
        with_rm.reward.reward_model.enable = True
    assert not rule_based_reward(with_rm)


class _Server:
    """A rollout server's `generate.remote(...)` as the client awaits it (a Ray handle's call shape)."""

    def __init__(self):
        self.calls = []

        async def generate(**kwargs):
            self.calls.append(kwargs)
            return TokenOutput(token_ids=[7, 8], log_probs=None, stop_reason="completed", extra_fields={"global_steps": 3})

        self.generate = type("M", (), {"remote": staticmethod(generate)})


def test_single_server_client_calls_the_server_without_a_load_balancer(config):
    server = _Server()
    client = SingleServerClient(config, "hf-replica-0:0", server)
    assert client._load_balancer is None  # any balancer call would raise on None
    out = asyncio.run(client.generate("req-1", prompt_ids=[1, 2, 3], sampling_params={"temperature": 1.0}))
    assert out.token_ids == [7, 8] and out.extra_fields["min_global_steps"] == 3
    assert [c["prompt_ids"] for c in server.calls] == [[1, 2, 3]]


def test_upstream_call_shapes_the_shortcuts_rely_on():
    score_src = inspect.getsource(AgentLoopWorker._compute_score)
    assert "random.choice(self.reward_loop_worker_handles)" in score_src
    assert ".compute_score.remote(data)" in score_src
    gen_src = inspect.getsource(llm_server.LLMServerClient.generate)
    assert "await self._acquire_server(" in gen_src and "self._release_server(" in gen_src
    assert "await server.generate.remote(" in gen_src
    assert inspect.iscoroutinefunction(llm_server.LLMServerClient._acquire_server)
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    assert inspect.iscoroutinefunction(RewardLoopWorker.compute_score)
