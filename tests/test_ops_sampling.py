"""Per-sample seeded sampling of the hf rollout backend (opd_patches/ops/seeded_sampling.py).

What a resume needs: a sample's tokens depend only on (rollout seed, step, sample key), not on the
batch it was run in, the order requests arrived in, or anything sampled before; and the draws are
still exact samples from the warped distribution.
"""

import asyncio
import types

import opd_patches  # noqa: F401
import pytest
import torch
from verl.workers.config import RolloutConfig

from opd_patches.rollout import hf as hr
from opd_patches.ops.seeded_sampling import SampleKeys, SeededSampler, sample_seed

from conftest import sharpened

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25]]
PARAMS = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def sharp(embedded, tmp_path_factory):
    torch.set_num_threads(1)
    return sharpened(embedded["student"], tmp_path_factory.mktemp("sharp"), seed=123)


def server(path, step=3, **kw):
    cfg = dict(name="hf", prompt_length=64, response_length=16, tensor_model_parallel_size=1, **kw)
    s = hr.HFServer(RolloutConfig(**cfg), types.SimpleNamespace(local_path=str(path)), replica_rank=0)
    s.global_steps = step
    return s


def run(s, reqs, together=True):
    async def go():
        if together:
            return await asyncio.gather(*(s.generate(p, dict(PARAMS), request_id=r) for p, r in reqs))
        return [await s.generate(p, dict(PARAMS), request_id=r) for p, r in reqs]

    return [o.token_ids for o in asyncio.run(go())]


def test_samples_do_not_depend_on_batching_or_history(sharp):
    reqs = [(p, f"u{i}") for i, p in enumerate(PROMPTS * 2)]  # every prompt twice, as with rollout.n=2
    batched = run(server(sharp), reqs)
    torch.manual_seed(999)
    torch.rand(1000)  # the global RNG is irrelevant
    one_by_one = run(server(sharp), reqs, together=False)
    assert batched == one_by_one
    # Another arrival order: each (prompt, occurrence) still gets the same tokens.
    order = [1, 4, 0, 2, 5, 3]
    shuffled = run(server(sharp), [reqs[i] for i in order])
    assert [batched[i] for i in order] == shuffled
    assert batched[0] != batched[3]  # two samples of one prompt differ (streams 0 and 1)
    # Another step (weight version) or rollout seed: other samples.
    assert run(server(sharp, step=4), reqs) != batched
    assert run(server(sharp, seed=7), reqs) != batched


def test_request_ids_are_not_the_keys(sharp):
    # VERL V1's agent loop gives every sample priority 0: under full_determinism all request ids are
    # det-0. The n samples of one prompt must still get different streams (prompt, occurrence).
    a = run(server(sharp), [(PROMPTS[0], "det-0"), (PROMPTS[0], "det-0")])
    assert a[0] != a[1]
    assert a == run(server(sharp), [(PROMPTS[0], "x"), (PROMPTS[0], "y")])
    keys = SampleKeys()
    first, second, next_step = keys.key(1, [1]), keys.key(1, [1]), keys.key(2, [1])
    assert first.endswith("#0") and second.endswith("#1") and next_step == first  # counters restart per step


def logprobs(s, reqs, together=True):
    async def go():
        params = {**PARAMS, "logprobs": True}
        if together:
            return await asyncio.gather(*(s.generate(p, dict(params), request_id=r) for p, r in reqs))
        return [await s.generate(p, dict(params), request_id=r) for p, r in reqs]

    return [(o.token_ids, o.log_probs) for o in asyncio.run(go())]


def test_full_determinism_makes_log_probs_batch_invariant(sharp):
    # Batched, a row's logits depend on the batch's shape (padding, size) in their last bits; under
    # rollout.full_determinism each request runs alone, so tokens and log-probs are bit-identical
    # however the requests arrived.
    reqs = [(p, f"u{i}") for i, p in enumerate(PROMPTS * 2)]
    together = logprobs(server(sharp, full_determinism=True), reqs)
    alone = logprobs(server(sharp, full_determinism=True), reqs, together=False)
    assert together == alone


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 1.0), (0.7, 3, 1.0), (1.3, None, 0.8)])
def test_draws_follow_the_warped_distribution(temperature, top_k, top_p):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 4000
    sampler = SeededSampler([sample_seed(0, 1, f"k{i}") for i in range(n)], temperature, top_p, top_k)
    noisy = sampler(torch.zeros(n, 1, dtype=torch.long), logits.expand(n, -1).clone())
    counts = torch.bincount(noisy.argmax(-1), minlength=6).float() / n
    expected = torch.softmax(sampler.processed[0][0], -1)  # the warped distribution (filtered tokens: 0)
    assert (counts[expected == 0] == 0).all()
    assert torch.allclose(counts, expected, atol=0.03), (counts, expected)


def test_upstream_still_orders_the_step_in_balance_batch():
    """OpsTrainerMixin._balance_batch puts each step's samples in a canonical order (content hash). That
    relies on upstream calling _balance_batch on the replay buffer's batch before any log-prob or update
    and on the agent loop storing `input_ids`; if this fails after a VERL upgrade, re-read those places."""
    import inspect

    from verl.trainer.ppo.v1 import agent_loop_tq, trainer_base

    src = inspect.getsource(trainer_base.PPOTrainer._step_once)
    sample, balance = src.index("self.replay_buffer.sample("), src.index("self._balance_batch(batch")
    assert sample < balance < src.index("self._compute_old_log_prob(batch") < src.index("self._update_actor(batch")
    assert 'field["input_ids"] = input_ids' in inspect.getsource(agent_loop_tq.AgentLoopWorkerTQ._agent_loop_postprocess)
