"""Build the embedded default assets: tokenizer, tiny student/teacher Qwen2 models, toy math data.

Everything is generated in code (no downloads, no copied datasets) so recipes and tests can run
offline.  Output layout under ``--out DIR``::

    tokenizer/            PreTrainedTokenizerFast (byte-level BPE + ChatML template)
    student/, teacher/    Qwen2ForCausalLM (seed 0 / seed 1) + tokenizer + generation_config
    data/train.parquet    VERL RL parquet schema
    data/val.parquet
    .complete             JSON marker, written last; a matching marker means "skip rebuild"

Usage: ``python -m opd_patches.embedded.build --out DIR`` or ``build(Path(DIR))``.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

# Bump when the output changes in a way PARAMS does not capture (e.g. corpus or template text).
BUILD_VERSION = 1

PARAMS = {
    "version": BUILD_VERSION,
    "tokenizer": {"vocab_size": 448, "min_frequency": 2, "corpus_seed": 1234},
    "model": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "vocab_multiple": 64,
    },
    "seeds": {"student": 0, "teacher": 1},
    "data": {"seed": 2024, "n_train": 64, "n_val": 16},
    # VERL 0.9.1 default_compute_score routes this to math_reward (last \boxed{} vs ground truth).
    "data_source": "lighteval/MATH",
}

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# Qwen2-style ChatML (no default system prompt, to keep toy prompts short).  String literals with
# '\n' rather than raw newlines so jinja whitespace control cannot eat the separators.
CHAT_TEMPLATE = (
    r"{%- for message in messages %}"
    r"{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    r"{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split: single digits (keeps arithmetic tokenization uniform) and newline
# runs split from text, so "\n" on its own is always exactly one byte-level token.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

NAMES = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry"]
ITEMS = ["apples", "books", "coins", "pencils", "stickers", "marbles", "cookies", "cards"]


def _problem(rng: random.Random) -> tuple[str, int]:
    """One arithmetic word problem with a non-negative integer answer."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 30), rng.randint(2, 12), rng.randint(2, 9)
    kind = rng.randrange(5)
    if kind == 0:
        return f"{name} has {a} {item}. {name} buys {b} more. How many {item} does {name} have now?", a + b
    if kind == 1:
        a += b  # keep the answer positive
        return f"{name} had {a} {item} and gave {b} to a friend. How many {item} are left?", a - b
    if kind == 2:
        return f"A box holds {b} {item}. How many {item} are in {c} boxes?", b * c
    if kind == 3:
        return f"{name} shares {b * c} {item} equally among {c} friends. How many {item} does each friend get?", b
    return f"What is {a} + {b} \\times {c}?", a + b * c


def _corpus() -> list[str]:
    """Tokenizer training text: chat scaffolding, instructions, word problems and LaTeX answers."""
    rng = random.Random(PARAMS["tokenizer"]["corpus_seed"])
    lines = [
        "system\nYou are a helpful assistant.\nuser\nassistant\n",
        "First, we add the numbers. Then we subtract. Next, we multiply. Finally, we divide.",
        "Therefore, the answer is \\boxed{0}. So the total is $x + y = 10$ and $\\frac{1}{2} \\cdot 4 = 2$.",
        "Let $n$ be the number of items. We have $n = 3 \\times 4 = 12$, so $\\sqrt{16} = 4$.",
        "0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } . , ? !",
    ]
    for _ in range(400):
        question, answer = _problem(rng)
        # Rendered-chat shape (minus special tokens) so role words become whole tokens too.
        lines.append(f"user\n{question}\n{INSTRUCTION}\nassistant\n")
        lines.append(f"We compute the result step by step. The answer is \\boxed{{{answer}}}.")
    return lines


def _train_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    # Same normalizer/pre-tokenizer as transformers' Qwen2Tokenizer, which AutoTokenizer rebuilds
    # from vocab+merges for qwen2 checkpoints: every loader then tokenizes identically.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=PARAMS["tokenizer"]["vocab_size"],
        min_frequency=PARAMS["tokenizer"]["min_frequency"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,  # like Qwen2: nothing is prepended to prompts
        model_max_length=PARAMS["model"]["max_position_embeddings"],
        clean_up_tokenization_spaces=False,  # exact decode(encode(x)) == x
        chat_template=CHAT_TEMPLATE,
    )


def _patch_json(path: Path, **updates) -> None:
    data = json.loads(path.read_text())
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _save_tokenizer(tokenizer, path: Path) -> None:
    tokenizer.save_pretrained(path)
    # transformers 5 writes "TokenizersBackend", which transformers 4 (e.g. inside a rollout
    # engine's environment) cannot resolve; real Qwen2 checkpoints name this class in both.
    _patch_json(path / "tokenizer_config.json", tokenizer_class="Qwen2Tokenizer")


def model_config(tokenizer, dims: dict):
    """A tied-embedding fp32 Qwen2Config of `dims` (PARAMS["model"]'s keys) over `tokenizer`'s vocabulary."""
    from transformers import Qwen2Config

    mult = dims["vocab_multiple"]
    return Qwen2Config(
        vocab_size=-(-len(tokenizer) // mult) * mult,
        hidden_size=dims["hidden_size"],
        intermediate_size=dims["intermediate_size"],
        num_hidden_layers=dims["num_hidden_layers"],
        num_attention_heads=dims["num_attention_heads"],
        num_key_value_heads=dims["num_key_value_heads"],
        max_position_embeddings=dims["max_position_embeddings"],
        max_window_layers=dims["num_hidden_layers"],
        tie_word_embeddings=True,
        dtype="float32",
        **_token_ids(tokenizer),
    )


def _token_ids(tokenizer) -> dict:
    # Qwen2 convention: bos id = <|endoftext|>, though the tokenizer never prepends it
    return {
        "bos_token_id": tokenizer.convert_tokens_to_ids(PAD),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def save_model(model, tokenizer, path: Path) -> None:
    """`model` (fp32) as a loadable HF folder with the tokenizer and a generation config."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(**_token_ids(tokenizer))
    model.save_pretrained(path, safe_serialization=True)
    # transformers 5 writes only "dtype"; readers built on transformers 4 look for "torch_dtype".
    _patch_json(path / "config.json", torch_dtype="float32")
    _save_tokenizer(tokenizer, path)


def _save_model(tokenizer, seed: int, path: Path) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    config = model_config(tokenizer, PARAMS["model"])
    # fork_rng: seed the init without disturbing the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    save_model(model, tokenizer, path)


def _write_data(path: Path) -> tuple[Path, Path]:
    import pandas as pd

    d = PARAMS["data"]
    rng = random.Random(d["seed"])
    problems: dict[str, int] = {}
    while len(problems) < d["n_train"] + d["n_val"]:  # unique questions: no train/val overlap
        q, a = _problem(rng)
        problems.setdefault(q, a)
    items = list(problems.items())
    out = {}
    for split, chunk in (("train", items[: d["n_train"]]), ("val", items[d["n_train"] :])):
        rows = [
            {
                "data_source": PARAMS["data_source"],
                "prompt": [{"role": "user", "content": f"{q}\n{INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a)},
                "extra_info": {"split": split, "index": i, "question": q, "answer": str(a)},
            }
            for i, (q, a) in enumerate(chunk)
        ]
        out[split] = path / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(out[split], index=False)
    return out["train"], out["val"]


ASSETS = ("tokenizer", "student", "teacher", "data")
MARKER = ".complete"


def _params_hash(params: dict) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()


def _paths(out: Path) -> dict[str, Path]:
    return {
        "student": out / "student",
        "teacher": out / "teacher",
        "tokenizer": out / "tokenizer",
        "train": out / "data" / "train.parquet",
        "val": out / "data" / "val.parquet",
    }


def is_complete(out: Path, params: dict | None = None) -> bool:
    """A marker written for these parameters (default: the embedded default's) exists in `out`."""
    try:
        marker = json.loads((Path(out) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("params_hash") == _params_hash(PARAMS if params is None else params)


@contextmanager
def _lock(out: Path):
    # Several workers may build the same DIR at once; serialise them so only one writes.
    with open(out / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_set(out: Path, params: dict, write, label: str = "embedded") -> dict[str, Path]:
    """Build (or reuse) one asset set under `out`: `write(tmp)` writes ASSETS into the folder `tmp` and
    returns extra marker fields; the assets are swapped in, then the marker is written last."""
    out = Path(out).resolve()
    paths = _paths(out)
    if is_complete(out, params):
        print(f"[{label}] up to date: {out}")
        return paths
    out.mkdir(parents=True, exist_ok=True)
    with _lock(out):
        if is_complete(out, params):  # another process finished while we waited
            print(f"[{label}] up to date: {out}")
            return paths
        (out / MARKER).unlink(missing_ok=True)  # stale marker must not vouch for a partial swap
        for stale in out.glob(".tmp-*"):  # leftovers of crashed builds
            shutil.rmtree(stale, ignore_errors=True)
        # Only a build imports transformers: run.sh asks before every launch, and "up to date" needs none.
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # keep the output to one line per asset
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out))  # same filesystem -> atomic renames
        try:
            extra = write(tmp) or {}
            trash = tmp / ".old"
            trash.mkdir()
            for name in [*ASSETS, *extra.pop("_extra_assets", [])]:
                if (out / name).exists():
                    os.replace(out / name, trash / name)
                os.replace(tmp / name, out / name)
                print(f"[{label}] wrote {name}: {out / name}")
            marker = {
                "version": params["version"],
                "params_hash": _params_hash(params),
                "assets": {k: str(v.relative_to(out)) for k, v in paths.items()},
                **extra,
            }
            (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
            os.replace(tmp / MARKER, out / MARKER)  # last: marks the whole set as complete
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return paths


def _write_default(tmp: Path) -> dict:
    tokenizer = _train_tokenizer()
    _save_tokenizer(tokenizer, tmp / "tokenizer")
    _save_model(tokenizer, PARAMS["seeds"]["student"], tmp / "student")
    _save_model(tokenizer, PARAMS["seeds"]["teacher"], tmp / "teacher")
    (tmp / "data").mkdir()
    _write_data(tmp / "data")
    return {"vocab_size": len(tokenizer)}


def build(out: Path) -> dict[str, Path]:
    """Build (or reuse) the embedded default under ``out``; return their paths."""
    return build_set(out, PARAMS, _write_default)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    build(parser.parse_args(argv).out)


if __name__ == "__main__":
    main()
