"""`torch_varlen` (opd_patches/attention/torch_varlen.py): packed sequences attend exactly as each sequence
alone under causal attention, forward and backward, on the CPU fallback and through the varlen kernel's
dispatch (stand-ins of torch 2.11's signature and of the later `enable_gqa` one, computing with sdpa);
boundaries from position_ids; the auto choice; a tiny Qwen2 through transformers' registries.

float64 throughout, so equalities hold to ~1e-12 whatever the machine's kernels.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from fresh_verl import facts
from opd_patches.attention import torch_varlen as tv

H, HKV, D = 4, 2, 8  # GQA, as R1-Distill-1.5B's 12 / 2
LENGTHS = [5, 1, 7, 1, 3]


def reference(q, k, v, lengths, scale=None):
    """Each sequence alone, batched causal sdpa with KV heads repeated (independent of the module)."""
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v))
        ks, vs = ks.repeat_interleave(H // HKV, dim=1), vs.repeat_interleave(H // HKV, dim=1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def packed_qkv(lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return [torch.randn(t, h, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (H, HKV, HKV)]


def position_ids(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]


def grads(out, inputs, seed=1):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs)


def attend(q, k, v, pos):
    """The registered attention function on packed (T, H, D) tensors in transformers' layout."""
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = tv.torch_varlen_attention_forward(
        module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None,
        scaling=0.3, position_ids=pos)
    return out[0]  # (T, H, D)


# ---- sequence boundaries -------------------------------------------------------------------------

def test_boundaries_from_restarting_position_ids():
    cu, longest = tv.cu_seqlens_from_position_ids(position_ids(LENGTHS), 1, sum(LENGTHS), "cpu")
    assert cu.tolist() == [0, 5, 6, 13, 14, 17] and cu.dtype == torch.int32 and longest == 7


def test_boundaries_every_row_starts_a_sequence_and_position_ids_may_be_shared():
    # (1, L) position ids expanded over a batch of 2 rows, as transformers makes them
    cu, longest = tv.cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0]]), 2, 4, "cpu")
    assert cu.tolist() == [0, 3, 4, 7, 8] and longest == 3
    cu, longest = tv.cu_seqlens_from_position_ids(None, 3, 4, "cpu")
    assert cu.tolist() == [0, 4, 8, 12] and longest == 4
    # a row that does not start at position 0 (VERL's bucket padding restarts at 0: its own segment)
    cu, _ = tv.cu_seqlens_from_position_ids(torch.tensor([[3, 4, 0, 1, 0, 1]]), 1, 6, "cpu")
    assert cu.tolist() == [0, 2, 4, 6]


def test_all_length_one_sequences():
    q, k, v = packed_qkv([1, 1, 1])
    cu, longest = tv.cu_seqlens_from_position_ids(torch.zeros(1, 3, dtype=torch.long), 1, 3, "cpu")
    assert cu.tolist() == [0, 1, 2, 3] and longest == 1
    torch.testing.assert_close(attend(q, k, v, torch.zeros(1, 3, dtype=torch.long)),
                               reference(q, k, v, [1, 1, 1], scale=0.3), rtol=0, atol=1e-12)


# ---- the CPU fallback, forward and backward ------------------------------------------------------

def test_fallback_equals_each_sequence_alone_forward_and_backward():
    q, k, v = packed_qkv()
    assert tv.kernel_for(q) is None  # CPU, float64: the exact per-sequence path
    out, ref = attend(q, k, v, position_ids(LENGTHS)), reference(q, k, v, LENGTHS, scale=0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, r in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


def test_fallback_differs_from_attention_across_boundaries():
    """The check above could fail: one causal sequence over the packed row gives other outputs."""
    q, k, v = packed_qkv()
    whole = reference(q, k, v, [sum(LENGTHS)], scale=0.3)
    assert (attend(q, k, v, position_ids(LENGTHS)) - whole).abs().max() > 1e-3


# ---- the varlen kernel's dispatch through stand-ins of its signatures ----------------------------

def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1)):
    """torch 2.11's varlen_attn signature, as `inspect.signature` printed it on the H200 host (torch
    2.11.0+cu130): causal iff window_size == (-1, 0), no GQA flag (KV heads must match query heads)."""
    assert window_size == (-1, 0), "causal attention is window_size=(-1, 0)"
    assert query.shape[1] == key.shape[1] == value.shape[1], "2.11 has no GQA flag: KV heads must be repeated"
    assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    assert max_q == max_k == int(cu_seq_q.diff().max())
    return tv.per_sequence_sdpa(query, key, value, cu_seq_q, scale)


def varlen_attn_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """The later signature (torch 2.13's CPU build): `enable_gqa`, KV heads passed as they are."""
    assert window_size == (-1, 0) and enable_gqa and key.shape[1] == HKV
    return tv.per_sequence_sdpa(query, key, value, cu_seq_q, scale)


@pytest.mark.parametrize("kernel", [varlen_attn_2_11, varlen_attn_gqa], ids=["torch-2.11", "enable_gqa"])
def test_varlen_dispatch_equals_each_sequence_alone(monkeypatch, kernel):
    calls = []

    @functools.wraps(kernel)  # keeps the signature the dispatch inspects
    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(tv, "kernel_for", lambda q: counted)
    q, k, v = packed_qkv(seed=3)
    out, ref = attend(q, k, v, position_ids(LENGTHS)), reference(q, k, v, LENGTHS, scale=0.3)
    assert calls, "the kernel was not called"
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, r in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


def test_kernel_only_where_flash_kernels_run():
    cpu = torch.zeros(2, H, D, dtype=torch.bfloat16)
    assert tv.kernel_for(cpu) is None


# ---- the auto choice -----------------------------------------------------------------------------

def test_auto_choice(monkeypatch):
    monkeypatch.setattr(tv, "flash_attn_installed", lambda: False)
    assert tv.resolve("auto", "cuda") == tv.NAME
    assert tv.resolve(None, "cuda") == tv.NAME
    assert tv.resolve("auto", "cpu") == "sdpa"
    assert tv.resolve("sdpa", "cuda") == "sdpa"
    assert tv.resolve(tv.NAME, "cpu") == tv.NAME  # explicit: the exact fallback on the CPU
    with pytest.raises(ValueError, match="flash-attn is not installed"):
        tv.resolve("flash_attention_2", "cuda")
    monkeypatch.setattr(tv, "flash_attn_installed", lambda: True)
    assert tv.resolve("auto", "cuda") == "flash_attention_2"
    assert tv.resolve("auto", "cpu") == "sdpa"
    with pytest.raises(ValueError, match=r"opd.attn_implementation='flash'.*auto, flash_attention_2"):
        tv.resolve("flash", "cuda")


def test_main_sets_upstream_key(monkeypatch):
    from omegaconf import OmegaConf

    from opd_patches.main import ConfigError, apply_attention

    monkeypatch.setattr(tv, "flash_attn_installed", lambda: False)
    def config(opd, upstream=None, sp=1):
        override = {} if upstream is None else {"attn_implementation": upstream}
        return OmegaConf.create({"opd": {"attn_implementation": opd}, "trainer": {"device": "cuda"},
                                 "actor_rollout_ref": {"model": {"override_config": override},
                                                       "actor": {"ulysses_sequence_parallel_size": sp}}})

    for opd, resolved in (("auto", tv.NAME), ("sdpa", "sdpa"), ("eager", "eager")):
        c = config(opd)
        apply_attention(c)
        assert c.actor_rollout_ref.model.override_config.attn_implementation == resolved
    with pytest.raises(ConfigError, match="opd.attn_implementation='bogus'"):
        apply_attention(config("bogus"))
    with pytest.raises(ConfigError, match="set opd.attn_implementation=sdpa instead"):
        apply_attention(config("auto", upstream="sdpa"))
    with pytest.raises(ConfigError, match="Ulysses"):
        apply_attention(config("auto", sp=2))


# ---- through transformers: a tiny Qwen2, packed as VERL packs it ---------------------------------

def tiny_qwen(attn):
    from transformers import AutoModelForCausalLM, Qwen2Config

    tv.register()
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=H, num_key_value_heads=HKV, max_position_embeddings=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float64)


def test_tiny_model_packed_equals_sdpa_per_sequence_forward_and_backward():
    model = tiny_qwen(tv.NAME)
    assert model.config._attn_implementation == tv.NAME
    ids = torch.randint(0, 97, (sum(LENGTHS),), generator=torch.Generator().manual_seed(2))
    packed = model(input_ids=ids[None], position_ids=position_ids(LENGTHS)).logits[0]
    g_packed = torch.autograd.grad(packed.pow(2).sum(), list(model.parameters()))

    model.set_attn_implementation("sdpa")
    alone = torch.cat([model(input_ids=s[None]).logits[0] for s in ids.split(LENGTHS)])
    g_alone = torch.autograd.grad(alone.pow(2).sum(), list(model.parameters()))
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-10)
    for a, b in zip(g_packed, g_alone):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_tiny_model_builds_no_mask_for_packed_rows_and_sdpa_masks_otherwise():
    from transformers.masking_utils import create_causal_mask

    model = tiny_qwen(tv.NAME)
    embeds = torch.zeros(1, sum(LENGTHS), 32, dtype=torch.float64)
    mask = create_causal_mask(model.config, embeds, None, None, position_ids=position_ids(LENGTHS))
    assert mask is None  # no (L, L) block-diagonal mask
    padding = torch.ones(2, 6, dtype=torch.long)
    padding[1, :2] = 0  # left padding: the sdpa path
    mask = create_causal_mask(model.config, torch.zeros(2, 6, 32, dtype=torch.float64), padding, None,
                              position_ids=torch.arange(6).expand(2, 6))
    assert mask is not None and mask.shape[-2:] == (6, 6)


def test_tiny_model_padded_batch_and_generation_match_sdpa():
    """Padding masks and the KV cache go to sdpa, so HF generation and padded scoring are unchanged."""
    model = tiny_qwen(tv.NAME)
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    ours = model(input_ids=ids, attention_mask=mask).logits
    gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(ours, model(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=1e-10)
    assert torch.equal(gen, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                           pad_token_id=0))


@pytest.mark.fresh_process
def test_registered_in_a_fresh_process_through_the_env_var():
    """transformers' attention and mask registries name torch_varlen in every Ray worker (tests/fresh_verl.py)."""
    assert facts("registered")["torch_varlen"] == [True, True]


@pytest.mark.parametrize("k", [0, 3])
def test_teacher_scores_packed_rows_the_same(monkeypatch, k):
    """The colocated teacher (opd_patches/teacher/scoring.py) packs its micro-batches under torch_varlen:
    same log-probs and ids as its padded sdpa path, lengths 1 and 2 included."""
    from opd_patches.teacher import scoring
    from opd_patches.teacher.scoring import score_sequences

    forwards = []
    for name in ("_packed_forward", "_padded_forward"):
        real = getattr(scoring, name)
        monkeypatch.setattr(scoring, name, lambda *a, _n=name, _r=real: forwards.append(_n) or _r(*a))
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, 97, (n,), generator=gen) for n in (9, 1, 4, 2, 7)]
    model = tiny_qwen(tv.NAME).eval()
    lp, ids = score_sequences(model, seqs, k, chunk_size=5, max_tokens=24)
    model.set_attn_implementation("sdpa")
    ref_lp, ref_ids = score_sequences(model, seqs, k, chunk_size=5, max_tokens=24)
    assert len(set(forwards)) == 2 and forwards[0] == "_packed_forward" and forwards[-1] == "_padded_forward"
    for a, b, c, d in zip(lp, ref_lp, ids, ref_ids):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert torch.equal(c, d)
