"""tools/spec_logprobs.py: the reference log-prob of each kept sample's tokens is the model's own (each token after
the prompt and the tokens before it, whatever the other samples' lengths), and a speculative engine's error shows
in its own row, at the positions it was planted."""

import json
import random

import pytest
import torch

from tools import spec_logprobs

VOCAB = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return path


def exact(model, prompt, sample):
    """One sequence alone, no padding, float64 log-softmax: the log-prob of each of its tokens."""
    ids = torch.tensor([prompt + sample])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    rows = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return [rows[t, token].item() for t, token in enumerate(sample)]


def kept(model, rng, offset=0.0):
    """One engine's kept file: two prompts of different lengths, samples of 1 to 6 tokens, each token's log-prob
    exact (plus `offset` after the first position)."""
    prompts = {"a": [3, 7, 11], "b": [5, 1, 9, 2, 30]}
    out = {"samples": {}, "logprobs": {}, "prompt_ids": prompts, "counters": {}, "spec": None}
    for name, prompt in prompts.items():
        samples = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(9)]
        out["samples"][name] = samples
        out["logprobs"][name] = [[lp + (offset if t else 0.0) for t, lp in enumerate(exact(model, prompt, s))]
                                 for s in samples]
    return out


def test_the_reference_is_each_tokens_own_log_prob_and_an_error_shows_where_it_was_planted(model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = tmp_path / "exactness.json"
    assert spec_logprobs.main(["--out", str(out), "--model", str(model_dir)]) == 2  # nothing kept yet
    assert "missing" in capsys.readouterr().err
    out.with_suffix(".plain.json").write_text(json.dumps(kept(model, random.Random(1))))
    out.with_suffix(".spec.json").write_text(json.dumps(kept(model, random.Random(2), offset=0.05)))
    assert spec_logprobs.main(["--out", str(out), "--model", str(model_dir), "--batch", "4"]) == 0
    result = json.loads(out.with_suffix(".logprobs.json").read_text())
    for engine in ("plain", "spec"):
        assert result[engine]["first"]["tokens"] == 18 and result[engine]["first"]["max_abs"] < 1e-5
    assert result["plain"]["later"]["max_abs"] < 1e-5
    later = result["spec"]["later"]
    assert later["tokens"] > 0 and later["mean"] == pytest.approx(0.05, abs=1e-5)
    assert later["max_abs"] == pytest.approx(0.05, abs=1e-5)


def test_files_without_log_probs_are_refused(model_dir, tmp_path, capsys):
    out = tmp_path / "exactness.json"
    for engine in ("plain", "spec"):
        out.with_suffix(f".{engine}.json").write_text(json.dumps({"samples": {"a": [[1]]}, "counters": {}}))
    assert spec_logprobs.main(["--out", str(out), "--model", str(model_dir)]) == 2
    assert "no log-probs" in capsys.readouterr().err
