"""Tests for the embedded default assets (opd_patches.embedded.build)."""

import hashlib
import time

import pandas as pd
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd_patches.embedded.build import INSTRUCTION, MARKER, build

PROMPT = [{"role": "user", "content": f"What is 12 + 7 \\times 3?\n{INSTRUCTION}"}]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build(tmp_path_factory.mktemp("embedded") / "assets")


@pytest.fixture(scope="module")
def models(assets):
    return {k: AutoModelForCausalLM.from_pretrained(assets[k]).eval() for k in ("student", "teacher")}


def _snapshot(root):
    """path -> (mtime_ns, sha256) for every built file (the lock file is not an asset)."""
    return {
        p.relative_to(root): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.mark.parametrize("which", ["tokenizer", "student", "teacher"])
def test_tokenizer(assets, which):
    tok = AutoTokenizer.from_pretrained(assets[which])
    assert len(tok.encode("\n", add_special_tokens=False)) == 1  # VERL's Qwen builder requires it
    digits = tok.encode("2024", add_special_tokens=False)
    assert len(digits) == 4 and tok.decode(digits) == "2024"  # one token per digit, like Qwen2
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert 320 <= len(tok) <= 512

    text = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text == f"<|im_start|>user\n{PROMPT[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert not tok.apply_chat_template(PROMPT, tokenize=False).endswith("assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # AutoTokenizer rebuilds a Qwen2Tokenizer; it must agree with the raw tokenizer.json.
    assert ids == Tokenizer.from_file(str(assets["tokenizer"] / "tokenizer.json")).encode(text).ids


def test_models(assets, models):
    tok = AutoTokenizer.from_pretrained(assets["tokenizer"])
    student, teacher = models["student"], models["teacher"]
    for model in (student, teacher):
        cfg = model.config
        assert type(model).__name__ == "Qwen2ForCausalLM" and cfg.tie_word_embeddings
        assert cfg.vocab_size >= len(tok) and cfg.vocab_size % 64 == 0
        assert (cfg.eos_token_id, cfg.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
        assert cfg.bos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
        gen = model.generation_config
        assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (
            cfg.eos_token_id,
            cfg.pad_token_id,
            cfg.bos_token_id,
        )
        assert all(p.dtype == torch.float32 for p in model.parameters())

        # Independent count: tied embedding, q/k/v with bias, o without, SwiGLU MLP, RMSNorms.
        h, i, n_layers, heads, kv = 64, 128, 2, 4, 2
        kv_dim = kv * (h // heads)
        attn = (h * h + h) + 2 * (h * kv_dim + kv_dim) + h * h
        per_layer = attn + 3 * h * i + 2 * h
        expected = cfg.vocab_size * h + n_layers * per_layer + h
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (h, i, n_layers)
        assert sum(p.numel() for p in model.parameters()) == expected

    s, t = student.state_dict(), teacher.state_dict()
    assert s.keys() == t.keys()
    assert not torch.equal(s["model.embed_tokens.weight"], t["model.embed_tokens.weight"])


def test_generate(assets, models):
    tok = AutoTokenizer.from_pretrained(assets["student"])
    inputs = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    for model in models.values():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        assert out.shape[0] == 1 and inputs["input_ids"].shape[1] < out.shape[1] <= inputs["input_ids"].shape[1] + 8


def test_data(assets):
    from verl.utils.reward_score import default_compute_score

    train, val = pd.read_parquet(assets["train"]), pd.read_parquet(assets["val"])
    assert (len(train), len(val)) == (64, 16)
    questions = set()
    for split, df in (("train", train), ("val", val)):
        assert list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        for i, row in enumerate(df.itertuples()):
            (msg,) = row.prompt
            assert msg["role"] == "user" and msg["content"].endswith(INSTRUCTION)
            assert row.ability == "math" and row.reward_model["style"] == "rule"
            assert row.extra_info["split"] == split and row.extra_info["index"] == i
            answer = row.reward_model["ground_truth"]
            assert answer.isdigit()
            questions.add(row.extra_info["question"])
    assert len(questions) == 80  # no duplicates, no train/val overlap

    row = train.iloc[0]
    answer = row.reward_model["ground_truth"]
    assert default_compute_score(row.data_source, f"So the answer is \\boxed{{{answer}}}.", answer) == 1.0
    assert default_compute_score(row.data_source, f"\\boxed{{{int(answer) + 1}}}", answer) == 0.0


def test_rebuild_skipped_and_deterministic(assets):
    root = assets["student"].parent
    before = _snapshot(root)
    start = time.perf_counter()
    assert build(root) == assets
    assert time.perf_counter() - start < 1.0
    assert _snapshot(root) == before  # nothing rewritten

    # Without the marker everything is rebuilt, byte-identical (deterministic build).
    (root / MARKER).unlink()
    build(root)
    after = _snapshot(root)
    assert after.keys() == before.keys()
    changed = [str(k) for k in before if after[k][1] != before[k][1]]
    assert not changed, f"rebuilt with other bytes: {changed}"
    assert not list(root.glob(".tmp-*"))  # temp dir cleaned up
