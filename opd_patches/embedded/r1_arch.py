"""The DeepSeek-R1-Distill-Qwen-1.5B architecture with random weights, built in code (no downloads).

    python -m opd_patches.embedded.r1_arch --out DIR [--seeds 0 1] [--device cuda]

For GPU runs and benchmarks at the real size: hidden 1536, 28 layers, 12 query / 2 KV heads,
intermediate 8960, vocabulary 151,936, untied embeddings, bf16; 1,777,088,000 parameters.
Writes `DIR/seed<S>/` (model + tokenizer + generation config) for each seed.

The tokenizer is the embedded default's (opd_patches/embedded/build.py: byte-level BPE, Qwen2's
pre-tokenizer, ChatML template, "\\n" one token) grown to Qwen2's 151,643 regular tokens with
synthetic merges, so every id a random model samples below that decodes to text, as with the real
tokenizer (ids 151,643..151,935 are padding rows there too). Token boundaries in real text differ
from Qwen's; lengths and throughput at a given token count do not.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from opd_patches.embedded.build import PAD, _save_tokenizer, _train_tokenizer

R1_DISTILL_1_5B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "max_window_layers": 21,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
PARAMETERS = 1_777_088_000  # DeepSeek-R1-Distill-Qwen-1.5B's count
REGULAR_TOKENS = 151_643  # Qwen2's BPE vocabulary without special tokens


def r1_distill_config(**ids):
    """Qwen2Config of DeepSeek-R1-Distill-Qwen-1.5B (bf16); `ids` sets bos/eos/pad token ids."""
    from transformers import Qwen2Config

    return Qwen2Config(**R1_DISTILL_1_5B, dtype="bfloat16", **ids)


def full_vocab_tokenizer():
    """The embedded tokenizer with synthetic byte-pair merges up to REGULAR_TOKENS entries."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    base = _train_tokenizer()
    spec = json.loads(base.backend_tokenizer.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    specials = {t["content"] for t in spec["added_tokens"]}
    alphabet = sorted(t for t in vocab if len(t) == 1 and t not in specials)  # the 256 byte symbols
    # Two-symbol tokens first, then three-symbol ones built from them: each merge joins two tokens
    # that already exist, so the BPE model stays valid.
    pairs = ((a, b) for a in alphabet for b in alphabet)
    triples = ((a + b, c) for a in alphabet for b in alphabet for c in alphabet)
    for left, right in itertools.chain(pairs, triples):
        if len(vocab) >= REGULAR_TOKENS:
            break
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append([left, right])
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        bos_token=None,
        model_max_length=R1_DISTILL_1_5B["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        chat_template=base.chat_template,
    )


def build_model(tokenizer, seed: int, out: Path, device: str = "cpu") -> Path:
    """Random-weight R1-Distill-1.5B-architecture model + tokenizer saved in `out`."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    ids = {
        "bos_token_id": tokenizer.convert_tokens_to_ids(PAD),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = r1_distill_config(**ids)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        if device.startswith("cuda"):
            torch.cuda.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    if count != PARAMETERS:
        raise RuntimeError(f"built {count:,} parameters, expected {PARAMETERS:,}: the config drifted")
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out, safe_serialization=True)
    config_json = out / "config.json"
    data = json.loads(config_json.read_text())
    data["torch_dtype"] = "bfloat16"  # readers built on transformers 4 look for this key
    config_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    _save_tokenizer(tokenizer, out)
    return out


def build(out: Path, seeds=(0, 1), device: str = "cpu") -> list[Path]:
    """One model folder per seed under `out` (skips folders that already hold weights)."""
    out = Path(out)
    tokenizer = None
    paths = []
    for seed in seeds:
        path = out / f"seed{seed}"
        if not (path / "model.safetensors.index.json").exists() and not (path / "model.safetensors").exists():
            tokenizer = tokenizer or full_vocab_tokenizer()
            start = time.monotonic()
            build_model(tokenizer, seed, path, device)
            print(f"[r1_arch] seed {seed}: {PARAMETERS:,} parameters in {path} ({time.monotonic() - start:.0f} s)")
        paths.append(path)
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--device", default="cpu", help="where to draw the weights (cuda is much faster)")
    args = parser.parse_args(argv)
    build(args.out, args.seeds, args.device)


if __name__ == "__main__":
    main()
