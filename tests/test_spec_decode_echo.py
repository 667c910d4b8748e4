"""tools/bench/echo_model.py: the echo copy of a Qwen2 checkpoint gives each position the logits of its own token's
normed embedding, repeats its last token as often as r(T) says, and leaves the source folder as it was; the
specdecode bench names and pairs the echo model's rows apart from the random one's."""

import hashlib
import json

import pytest
import torch

from tools.bench import echo_model
from tools.bench.spec_decode import pair_rows

VOCAB, HIDDEN, EPS = 64, 32, 1e-6
T = 0.75  # r(T) near one half for this initializer range, width and lm_head scale: repeats and jumps both common


def tiny_source(path, sharded: bool, tied: bool = False):
    """A random tiny Qwen2ForCausalLM (untied unless `tied`, random final norm weights) saved in `path`, with a
    tokenizer file."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.2, rms_norm_eps=EPS, tie_word_embeddings=tied)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
        with torch.no_grad():
            model.model.norm.weight.uniform_(0.5, 1.5)  # the closed form must carry the norm's weights
    model.save_pretrained(path, max_shard_size="20KB" if sharded else "1GB")
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    return path


def digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def closed_form(folder):
    """(logits of each token id, r_x(T) of each token id) from the source's embedding and final norm alone."""
    from safetensors import safe_open

    tensors = {}
    for shard in set(echo_model.weight_map(folder).values()):
        with safe_open(folder / shard, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    table = tensors["model.embed_tokens.weight"].double()
    gain = tensors["model.norm.weight"].double()
    hidden = table * torch.rsqrt(table.pow(2).mean(-1, keepdim=True) + EPS) * gain
    logits = echo_model.SCALE * hidden @ table.T
    return logits, torch.softmax(logits / T, dim=-1).diagonal()


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_echo_logits_are_the_normed_own_embedding_and_the_source_is_untouched(tmp_path, sharded):
    from transformers import AutoModelForCausalLM

    src = tiny_source(tmp_path / "src", sharded)
    assert ((src / echo_model.INDEX).exists()) == sharded
    before = digests(src)
    out = echo_model.write_echo(src, tmp_path / "echo")
    assert digests(src) == before
    assert not (tmp_path / "echo.tmp").exists()
    after = digests(out)
    weights = set(echo_model.weight_map(src).values())
    assert set(after) == set(before)
    assert all(after[name] == before[name] for name in before if name not in weights)  # config, tokenizer, index
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    with pytest.raises(FileExistsError):
        echo_model.write_echo(src, out)

    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    echo = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # the same compute: every tensor keeps its shape and dtype
    assert {k: (v.shape, v.dtype) for k, v in echo.state_dict().items()} == \
           {k: (v.shape, v.dtype) for k, v in source.state_dict().items()}
    assert echo.lm_head.weight.data_ptr() != echo.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(echo.lm_head.weight, echo.model.embed_tokens.weight * echo_model.SCALE, rtol=0, atol=0)

    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    expected, _ = closed_form(src)
    with torch.no_grad():
        got = echo(input_ids=ids).logits.double()
        original = source(input_ids=ids).logits.double()
    torch.testing.assert_close(got, expected[ids], rtol=1e-5, atol=1e-5)
    assert (original - expected[ids]).abs().max() > 0.1  # the source's layers do move the logits


def test_a_tied_checkpoint_is_refused_before_anything_is_written(tmp_path):
    """The echo's lm_head is a scaled copy of the embedding: a checkpoint whose lm_head is its embedding has none
    to hold it."""
    src = tiny_source(tmp_path / "src", sharded=False, tied=True)
    with pytest.raises(KeyError, match="untied"):
        echo_model.write_echo(src, tmp_path / "echo")
    assert not (tmp_path / "echo").exists() and not (tmp_path / "echo.tmp").exists()


def test_echo_repeats_its_last_token_at_the_closed_form_rate(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_source(tmp_path / "src", sharded=False)
    out = echo_model.write_echo(src, tmp_path / "echo")
    _, repeat = closed_form(src)
    assert 0.3 < repeat.mean() < 0.7  # repeats and jumps both frequent: a wrong T or lm_head moves the count
    computed = echo_model.repeat_probability(out, [T], rows=VOCAB)[T]
    assert computed == pytest.approx(repeat.mean().item(), abs=1e-5)

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompts = torch.arange(16)[:, None] * 3 % VOCAB
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        seqs = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=T,
                              top_k=0, top_p=1.0, max_new_tokens=40, min_new_tokens=40, eos_token_id=None,
                              pad_token_id=0)
    prev, nxt = seqs[:, :-1], seqs[:, 1:]
    assert nxt.numel() == 16 * 40
    # each step repeats with the probability r of the token it follows: a sum of independent-given-the-past draws
    count = (nxt == prev).sum().item()
    mean = repeat[prev].sum().item()
    sd = (repeat[prev] * (1 - repeat[prev])).sum().sqrt().item()
    assert abs(count - mean) < 4 * sd, (count, mean, sd)


def test_echo_rows_are_named_and_paired_apart_from_the_random_ones():
    def row(model, engine, seconds):
        return {"model": model, "engine": engine, "batch": 32, "temperature": 1.3, "tokens": 512, "seconds": seconds}

    rows = pair_rows([row("random", "plain", 4.0), row("echo", "plain", 2.0), row("random", "spec", 5.0),
                      row("echo", "spec", 1.0)], "piecewise")
    by = {r["name"]: r for r in rows}
    assert set(by) == {"specdecode/piecewise/plain/b32/T1.3", "specdecode/piecewise/spec/b32/T1.3",
                       "specdecode/piecewise/echo/plain/b32/T1.3", "specdecode/piecewise/echo/spec/b32/T1.3"}
    assert by["specdecode/piecewise/echo/spec/b32/T1.3"]["ratio"] == 0.5
    assert by["specdecode/piecewise/spec/b32/T1.3"]["ratio"] == 1.25


def test_the_bench_hands_each_engine_child_the_echo_folder_and_its_temperatures(tmp_path, monkeypatch):
    """run_phase -> child command line -> the child's own argument parser -> rows paired, each with its r(T):
    everything of the GPU bench but the engine (a child here returns one row per batch and temperature)."""
    import argparse
    import subprocess

    from tools.bench import spec_decode

    src = tiny_source(tmp_path / "src", sharded=False)
    echo = echo_model.write_echo(src, tmp_path / "echo0")
    monkeypatch.setattr(spec_decode, "model_folder", lambda workdir, model: echo)
    seen = []

    def child(args):
        seen.append(args)
        return [{"model": args.model, "engine": args.engine, "batch": b, "temperature": t, "tokens": args.tokens,
                 "seconds": 2.0 if args.engine == "spec" else 4.0, "ms_per_token": 1.0, "startup_s": 1.0,
                 "drafts": 0.0, "drafted": 0.0, "accepted": 0.0, "accept_rate": None, "accept_length": None}
                for t in args.temperatures for b in args.batches]

    def run(cmd, cwd=None):
        assert cmd[1:4] == ["-m", "tools.bench.spec_decode", "child"]
        return subprocess.CompletedProcess(cmd, spec_decode.main(cmd[3:]))

    monkeypatch.setattr(spec_decode, "child", child)
    monkeypatch.setattr(spec_decode.subprocess, "run", run)
    args = argparse.Namespace(model="echo", workdir=tmp_path, batches=[32, 1], tokens=16, temperatures=None,
                              compile="piecewise", spec=None)
    entry = spec_decode.run_phase(args)
    assert [a.engine for a in seen] == ["plain", "spec"]
    assert all(a.path == echo and a.model == "echo" and a.compile == "piecewise" for a in seen)
    assert seen[0].temperatures == spec_decode.TEMPERATURES["echo"]
    assert entry["model"] == "echo" and len(entry["rows"]) == 2 * 2 * len(spec_decode.TEMPERATURES["echo"])
    spec_rows = [r for r in entry["rows"] if r["engine"] == "spec"]
    assert all(r["ratio"] == 0.5 and r["name"].startswith("specdecode/piecewise/echo/spec/") for r in spec_rows)
    r_of = echo_model.repeat_probability(echo, spec_decode.TEMPERATURES["echo"])
    assert {r["temperature"]: r["repeat_p"] for r in spec_rows} == {t: round(p, 4) for t, p in r_of.items()}
    assert r_of[2.0] < 0.5 < r_of[0.5]  # the temperature sets how often the model repeats
