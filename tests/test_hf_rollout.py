"""The `hf` rollout backend (opd_patches/rollout/hf.py), on CPU with the tiny embedded models.

Every expectation is computed independently of the code under test: from a plain full forward
pass (`model(ids).logits`), from an argmax loop without KV cache, from `model.generate`, or from
VERL's own vLLM prompt-log-prob extractor run on a fake vLLM output.

The embedded student/teacher are freshly initialised and near-uniform (greedy decoding just repeats
the last prompt token), which would make token-level comparisons toothless. Sampling tests therefore
use `sharp`: the student's architecture, config and tokenizer with its matrices re-drawn at a larger
scale (fixed seed), so greedy continuations depend on the whole context and are far from ties.
"""

import asyncio
import json
import shutil
import types

import pytest
import torch
from transformers import AutoModelForCausalLM
from verl.utils.device import get_device_name
from verl.workers.config import RolloutConfig

from opd_patches.rollout import hf as hr

from model_refs import fake_vllm_output, sharp_path_fixture, upstream_extractor

PROMPTS = [
    [5, 6, 7, 8, 9],
    [10, 11, 12],
    [20, 21, 22, 23, 24, 25, 26, 27, 28],
    [100, 200, 300, 400, 5, 6, 7, 8, 9, 10, 11, 12, 13],
]
LP_TOL = 1e-4


# ---- fixtures and independent references ---------------------------------------------------------
@pytest.fixture(scope="session")
def assets(embedded):
    return embedded  # conftest: the embedded models, built once


sharp_path = sharp_path_fixture("student", seed=123, scope="session")


@pytest.fixture(scope="session")
def models(assets, sharp_path):
    paths = {"student": assets["student"], "teacher": assets["teacher"], "sharp": sharp_path}
    return {k: AutoModelForCausalLM.from_pretrained(p).eval() for k, p in paths.items()}


@pytest.fixture(scope="session", autouse=True)
def cpu_platform():
    assert get_device_name() == "cpu", "VERL's platform was initialised before VERL_PLATFORM=cpu was set"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: intra-op threads only oversubscribe a busy host (seconds per test)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_server(path, **overrides):
    kw = dict(name="hf", prompt_length=64, response_length=16, tensor_model_parallel_size=1)
    kw.update(overrides)
    return hr.HFServer(RolloutConfig(**kw), types.SimpleNamespace(local_path=str(path)), replica_rank=0)


def gen(server, prompt, **params):
    return asyncio.run(server.generate(prompt, params, request_id="r"))


def gen_many(server, requests):
    """Submit (prompt, params) pairs concurrently; returns results in order."""

    async def go():
        return await asyncio.gather(
            *(server.generate(p, dict(sp), request_id=f"r{i}") for i, (p, sp) in enumerate(requests))
        )

    return asyncio.run(go())


def spy_groups(server):
    """Record the size of every batch the server runs."""
    sizes, real = [], server._run_group

    def wrapped(reqs):
        sizes.append(len(reqs))
        return real(reqs)

    server._run_group = wrapped
    return sizes


@torch.no_grad()
def direct_logp(model, ids):
    """(T, V) fp32 log-softmax of one plain forward pass over `ids`."""
    return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


@torch.no_grad()
def greedy_ref(model, prompt, n):
    """Greedy continuation by argmax over full forwards (no KV cache, no padding)."""
    ids, out = list(prompt), []
    for _ in range(n):
        t = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(t)
        out.append(t)
    return out


def assert_logprobs_match(model, prompt, out):
    """out.log_probs[j] == log p(out.token_ids[j] | prompt + out[:j]) under a direct forward."""
    assert out.log_probs is not None and len(out.log_probs) == len(out.token_ids)
    logp = direct_logp(model, prompt + out.token_ids)
    expect = [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(out.token_ids)]
    assert out.log_probs == pytest.approx(expect, abs=LP_TOL)


# ---- 1. prompt log-probs -------------------------------------------------------------------------
LENGTHS = [1, 2, 6, 11, 12, 23]  # with chunk 5: empty, one partial chunk, exact chunks, +1, several


@pytest.mark.parametrize("chunk", [5, hr.LOGPROB_CHUNK])
@pytest.mark.parametrize("k", [0, 4])
def test_prompt_logprobs_layout(models, sharp_path, monkeypatch, k, chunk):
    monkeypatch.setattr(hr, "LOGPROB_CHUNK", chunk)
    model, extract = models["sharp"], upstream_extractor()
    server = make_server(sharp_path)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    for n in LENGTHS:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        logp = direct_logp(model, ids)
        with torch.no_grad():
            lps, tops = hr.prompt_logprobs(model, torch.tensor(ids), k)
        width = max(k, 1)

        assert len(lps) == len(tops) == n
        assert all(len(r) == width for r in lps) and all(len(r) == width for r in tops)
        assert lps[-1] == [0.0] * width and tops[-1] == [0] * width
        for i in range(n - 1):
            if k == 0:
                assert tops[i] == [ids[i + 1]]
                assert lps[i] == pytest.approx([logp[i, ids[i + 1]].item()], abs=1e-5)
            else:
                ref = logp[i].topk(k)  # sorted descending
                assert tops[i] == ref.indices.tolist()
                assert lps[i] == pytest.approx(ref.values.tolist(), abs=1e-5)
                assert lps[i] == sorted(lps[i], reverse=True)

        # Layout parity with upstream: VERL's vLLM extractor on the equivalent vLLM output.
        upstream = {}
        extract(fake_vllm_output(logp, ids, k), k, upstream)
        assert tops == upstream["prompt_ids"]
        assert len(lps) == len(upstream["prompt_logprobs"])
        for ours, theirs in zip(lps, upstream["prompt_logprobs"], strict=True):
            assert ours == pytest.approx(theirs, abs=1e-5)

        # The same through the server, as the teacher loop asks for it.
        out = gen(server, ids, max_tokens=1, temperature=1.0, prompt_logprobs=k)
        assert out.extra_fields["prompt_ids"] == tops
        for ours, served in zip(lps, out.extra_fields["prompt_logprobs"], strict=True):
            assert served == pytest.approx(ours, abs=1e-5)
        assert out.token_ids == [int(logp[-1].argmax())]


def test_prompt_logprobs_requests_are_batched_separately(models, sharp_path):
    """Scoring, greedy and sampled requests arriving together are each answered correctly."""
    model, server = models["sharp"], make_server(sharp_path)
    sizes = spy_groups(server)
    ids = PROMPTS[3]
    torch.manual_seed(0)
    scored, greedy_a, greedy_b, sampled = gen_many(
        server,
        [
            (ids, {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}),
            (PROMPTS[0], {"max_tokens": 6, "temperature": 0, "ignore_eos": True}),
            (PROMPTS[1], {"max_tokens": 6, "temperature": 0, "ignore_eos": True}),
            (PROMPTS[2], {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True, "logprobs": True}),
        ],
    )
    assert sorted(sizes) == [1, 1, 2]  # one group per distinct sampling setting
    logp = direct_logp(model, ids)
    expect = [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert [r[0] for r in scored.extra_fields["prompt_logprobs"][:-1]] == pytest.approx(expect, abs=1e-5)
    assert greedy_a.token_ids == greedy_ref(model, PROMPTS[0], 6)
    assert greedy_b.token_ids == greedy_ref(model, PROMPTS[1], 6)
    assert len(sampled.token_ids) == 6
    assert_logprobs_match(model, PROMPTS[2], sampled)


# ---- 2. sampling semantics -----------------------------------------------------------------------
def test_greedy_matches_model_generate(models, sharp_path):
    model, server = models["sharp"], make_server(sharp_path)
    eos = model.generation_config.eos_token_id
    for prompt in PROMPTS:
        out = gen(server, prompt, temperature=0, max_tokens=10)
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, pad_token_id=0)
        hf = hf[0, len(prompt) :].tolist()
        if eos in hf:
            hf = hf[: hf.index(eos) + 1]
        assert out.token_ids == hf
        assert out.token_ids == greedy_ref(model, prompt, len(out.token_ids))
        assert out.stop_reason == "completed"


def test_max_tokens(models, sharp_path):
    model, server = models["sharp"], make_server(sharp_path)
    ref = greedy_ref(model, PROMPTS[0], 16)
    for n in (1, 3, 16):
        assert gen(server, PROMPTS[0], temperature=0, max_tokens=n, ignore_eos=True).token_ids == ref[:n]
    # Default: response_length; and different max_tokens within one batch are honoured per request.
    assert gen(server, PROMPTS[0], temperature=0, ignore_eos=True).token_ids == ref
    sizes = spy_groups(server)
    outs = gen_many(
        server, [(p, {"temperature": 0, "ignore_eos": True, "max_tokens": n}) for p, n in zip(PROMPTS, (2, 7, 4, 11))]
    )
    assert sizes == [4]  # max_tokens does not split a batch
    assert [len(o.token_ids) for o in outs] == [2, 7, 4, 11]
    assert outs[0].token_ids == ref[:2]
    # Bounded by the context window, as vLLM does; a prompt that fills it is rejected.
    small = make_server(sharp_path, max_model_len=20)
    prompt = PROMPTS[3]  # 13 tokens: room for 7
    assert len(gen(small, prompt, temperature=0, max_tokens=16, ignore_eos=True).token_ids) == 7
    with pytest.raises(ValueError, match="no room"):
        gen(small, list(range(3, 23)), temperature=0, max_tokens=4)


def test_eos_and_stop_tokens(models, sharp_path, tmp_path):
    model = models["sharp"]
    prompt = PROMPTS[0]
    ref = greedy_ref(model, prompt, 8)
    assert len(set(ref[:3])) == 3  # the stop tokens below must not occur earlier

    # A model whose EOS is its first greedy token.
    eos_path = tmp_path / "sharp_eos"
    shutil.copytree(sharp_path, eos_path)
    cfg_file = eos_path / "generation_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "eos_token_id": ref[0]}))
    eos_server = make_server(eos_path)
    assert eos_server.eos_ids == [ref[0]]
    assert gen(eos_server, prompt, temperature=0, max_tokens=8).token_ids == [ref[0]]  # EOS kept, then stop
    # ignore_eos neither stops at EOS nor suppresses it.
    assert gen(eos_server, prompt, temperature=0, max_tokens=8, ignore_eos=True).token_ids == ref

    server = make_server(sharp_path)
    assert gen(server, prompt, temperature=0, max_tokens=8, stop_token_ids=[ref[0]]).token_ids == [ref[0]]
    assert gen(server, prompt, temperature=0, max_tokens=8, stop_token_ids=[ref[2]]).token_ids == ref[:3]
    # vLLM honours stop_token_ids even with ignore_eos (ignore_eos concerns only the EOS token).
    out = gen(server, prompt, temperature=0, max_tokens=8, stop_token_ids=[ref[2]], ignore_eos=True)
    assert out.token_ids == ref[:3]
    # In a batch, a request that stops early does not cut the others short.
    a, b = gen_many(
        server,
        [(prompt, {"temperature": 0, "max_tokens": 8, "stop_token_ids": [ref[2]]}),
         (PROMPTS[2], {"temperature": 0, "max_tokens": 8, "stop_token_ids": [ref[2]]})],
    )
    assert a.token_ids == ref[:3]
    ref_b = greedy_ref(model, PROMPTS[2], 8)
    expect_b = ref_b[: ref_b.index(ref[2]) + 1] if ref[2] in ref_b else ref_b
    assert b.token_ids == expect_b


def test_logprobs(models, sharp_path):
    model, server = models["sharp"], make_server(sharp_path)
    for prompt in PROMPTS[:2]:
        out = gen(server, prompt, temperature=0, max_tokens=8, logprobs=True, ignore_eos=True)
        assert_logprobs_match(model, prompt, out)
    torch.manual_seed(1)
    out = gen(server, PROMPTS[2], temperature=1.0, max_tokens=8, logprobs=True, ignore_eos=True)
    assert_logprobs_match(model, PROMPTS[2], out)
    assert gen(server, PROMPTS[2], temperature=0, max_tokens=4).log_probs is None


def test_concurrent_requests_are_batched(models, sharp_path):
    """Left-padded batching gives each request its unbatched greedy result.

    Token ids are compared exactly: on the sharpened model the greedy margins are far larger than
    the ~1e-6 fp32 differences padding introduces (log-probs are compared at 1e-4 as well).
    """
    model, server = models["sharp"], make_server(sharp_path)
    params = {"temperature": 0, "max_tokens": 10, "logprobs": True, "ignore_eos": True}
    single = [gen(server, p, **params) for p in PROMPTS]
    sizes = spy_groups(server)
    batched = gen_many(server, [(p, params) for p in PROMPTS])
    assert sizes == [len(PROMPTS)]
    for prompt, s, b in zip(PROMPTS, single, batched, strict=True):
        assert b.token_ids == s.token_ids == greedy_ref(model, prompt, 10)
        assert b.log_probs == pytest.approx(s.log_probs, abs=LP_TOL)
        assert_logprobs_match(model, prompt, b)

    capped = make_server(sharp_path, max_num_seqs=2)
    sizes = spy_groups(capped)
    outs = gen_many(capped, [(p, params) for p in PROMPTS + PROMPTS[:1]])
    assert max(sizes) <= 2 and sum(sizes) == len(PROMPTS) + 1
    for prompt, o in zip(PROMPTS + PROMPTS[:1], outs, strict=True):
        assert o.token_ids == greedy_ref(model, prompt, 10)


def test_requests_sent_over_time_are_batched_until_a_quiet_window(sharp_path, monkeypatch):
    """Requests arriving every ~5 ms (as an agent loop sends a step's samples) form one generate() call,
    not one per fixed window; a pause longer than the window, or BATCH_MAX_WAIT_S, closes the batch."""
    server = make_server(sharp_path)
    sizes = spy_groups(server)
    params = {"temperature": 0.0, "max_tokens": 2}

    async def send(prompts, gap_s, pause_after=None, pause_s=0.0):
        tasks = []
        for i, p in enumerate(prompts):
            tasks.append(asyncio.ensure_future(server.generate(p, dict(params), request_id=f"r{i}")))
            await asyncio.sleep(pause_s if i == pause_after else gap_s)
        return await asyncio.gather(*tasks)

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    asyncio.run(send(prompts, 0.005))  # 12 x 5 ms = 60 ms: three fixed 20 ms windows
    assert sizes == [12]
    sizes.clear()
    asyncio.run(send(prompts, 0.002, pause_after=5, pause_s=5 * hr.BATCH_WINDOW_S))
    assert sizes == [6, 6]
    sizes.clear()
    monkeypatch.setattr(hr, "BATCH_MAX_WAIT_S", 0.03)
    asyncio.run(send(prompts, 0.01))
    assert len(sizes) > 1 and sum(sizes) == 12


def test_sampling(models, sharp_path):
    model, server = models["sharp"], make_server(sharp_path)
    vocab = model.config.vocab_size
    reqs = [(PROMPTS[0], {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True})] * 8

    first = [o.token_ids for o in gen_many(server, reqs)]
    again = [o.token_ids for o in gen_many(make_server(sharp_path), reqs)]
    assert first == again  # reproducible: per-sample seeds (opd_patches/ops/seeded_sampling.py)
    assert all(len(t) == 8 and all(0 <= x < vocab for x in t) for t in first)
    assert len({tuple(t) for t in first}) > 1  # identical prompts, independent samples

    # The sampling knobs reach the sampler: each of these degenerates to greedy.
    ref = greedy_ref(model, PROMPTS[0], 8)
    for knob in ({"temperature": 1e-4}, {"temperature": 1.0, "top_k": 1}, {"temperature": 1.0, "top_p": 1e-6}):
        torch.manual_seed(0)
        assert gen(server, PROMPTS[0], max_tokens=8, ignore_eos=True, **knob).token_ids == ref, knob


def test_rejects_multimodal(sharp_path):
    with pytest.raises(NotImplementedError):
        asyncio.run(make_server(sharp_path).generate([1, 2], {}, "r", image_data=[object()]))


# ---- 3. weight updates ---------------------------------------------------------------------------
def test_update_weights(models, assets):
    student, teacher = models["student"], models["teacher"]
    server, t_server = make_server(assets["student"]), make_server(assets["teacher"])
    params = {"temperature": 0, "max_tokens": 6, "logprobs": True, "ignore_eos": True}
    before_sum = asyncio.run(server.state_dict_checksum())
    teacher_sum = asyncio.run(t_server.state_dict_checksum())
    assert before_sum != teacher_sum
    before = gen(server, PROMPTS[2], **params)
    want = gen(t_server, PROMPTS[2], **params)
    assert before.log_probs != pytest.approx(want.log_probs, abs=LP_TOL)

    state = {k: v.clone() for k, v in teacher.state_dict().items()}
    assert asyncio.run(server.update_weights(state, global_steps=7)) == len(state)
    assert asyncio.run(server.state_dict_checksum()) == teacher_sum
    after = gen(server, PROMPTS[2], **params)
    assert after.token_ids == want.token_ids
    assert after.log_probs == pytest.approx(want.log_probs, abs=1e-6)
    assert after.extra_fields["global_steps"] == 7
    assert_logprobs_match(teacher, PROMPTS[2], after)
    scored = gen(server, PROMPTS[3], max_tokens=1, prompt_logprobs=0)
    logp = direct_logp(teacher, PROMPTS[3])
    expect = [logp[i, PROMPTS[3][i + 1]].item() for i in range(len(PROMPTS[3]) - 1)]
    assert [r[0] for r in scored.extra_fields["prompt_logprobs"][:-1]] == pytest.approx(expect, abs=1e-5)

    # The tied lm_head may be left out (it is the embedding); back to the student that way.
    assert student.config.tie_word_embeddings
    back = {k: v.clone() for k, v in student.state_dict().items() if k != "lm_head.weight"}
    asyncio.run(server.update_weights(back))
    assert asyncio.run(server.state_dict_checksum()) == before_sum
    assert gen(server, PROMPTS[2], **params).log_probs == pytest.approx(before.log_probs, abs=1e-6)


def test_update_weights_rejects_bad_keys(models, assets):
    server = make_server(assets["student"])
    checksum = asyncio.run(server.state_dict_checksum())
    good = {k: v.clone() for k, v in models["teacher"].state_dict().items()}

    with pytest.raises(KeyError, match="model.layers.0.bogus.weight"):
        asyncio.run(server.update_weights({**good, "model.layers.0.bogus.weight": torch.zeros(3)}))
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    with pytest.raises(KeyError, match="model.norm.weight"):
        asyncio.run(server.update_weights(missing))
    assert asyncio.run(server.state_dict_checksum()) == checksum  # nothing was half-loaded


# ---- 4. sleep / wake_up --------------------------------------------------------------------------
def test_sleep_wake_up_on_cpu(models, sharp_path):
    server = make_server(sharp_path)
    assert server.config.free_cache_engine  # the GPU path would offload; on CPU nothing happens
    ref = greedy_ref(models["sharp"], PROMPTS[1], 5)
    asyncio.run(server.sleep())
    assert server.awake
    assert all(p.device.type == "cpu" for p in server.model.parameters())
    assert gen(server, PROMPTS[1], temperature=0, max_tokens=5, ignore_eos=True).token_ids == ref
    asyncio.run(server.wake_up(["weights", "kv_cache"]))
    assert gen(server, PROMPTS[1], temperature=0, max_tokens=5, ignore_eos=True).token_ids == ref


def test_generate_while_asleep_fails_every_request_then_recovers(models, sharp_path):
    server = make_server(sharp_path)
    server.awake = False  # what sleep() leaves behind on a GPU

    async def both():
        requests = asyncio.gather(
            server.generate(PROMPTS[0], {"temperature": 0, "max_tokens": 2}, "a"),
            server.generate(PROMPTS[1], {"temperature": 0, "max_tokens": 2}, "b"),
            return_exceptions=True,
        )
        return await asyncio.wait_for(requests, timeout=30)  # a request left unanswered fails, not hangs

    errors = asyncio.run(both())
    assert all(isinstance(e, RuntimeError) and "asleep" in str(e) for e in errors)
    asyncio.run(server.wake_up(["weights"]))
    out = gen(server, PROMPTS[0], temperature=0, max_tokens=3, ignore_eos=True)
    assert out.token_ids == greedy_ref(models["sharp"], PROMPTS[0], 3)
