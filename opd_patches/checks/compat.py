"""Student/teacher compatibility: one check used before training (and by the teacher pre-flight).

Distillation compares the two models token by token, so they must share the vocabulary: the same
token -> id map and the same output width. A mismatch would silently score the wrong tokens.
Tokenizers are loaded by `load_tokenizers`, once per model path; the checks take them already loaded.
"""

import os
from functools import lru_cache
from pathlib import Path


class IncompatibleModels(ValueError):
    """The student and teacher cannot be distilled token by token; the message says why."""


def _local(path: str) -> Path | None:
    p = Path(os.path.expanduser(str(path)))
    return p if p.exists() else None


@lru_cache(maxsize=8)  # the input checks and the pre-flight of one launch read the same tokenizers
def load_tokenizer(path: str):
    """The tokenizer of a local model folder or a cached hub id; None if unreachable."""
    from transformers import AutoTokenizer

    kwargs = {} if _local(path) else {"local_files_only": True}
    try:
        return AutoTokenizer.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError):
        return None


def load_tokenizers(*paths: str) -> dict:
    """{path: tokenizer or None}, each distinct path loaded once (a self-distilling teacher shares it)."""
    loaded = {}
    for path in map(str, paths):
        if path not in loaded:
            loaded[path] = load_tokenizer(path)
    return loaded


def load_vocab(path: str, tokenizer):
    """(token -> id map, config vocab_size) of a model whose tokenizer is already loaded; None if unreachable."""
    from transformers import AutoConfig

    if tokenizer is None:
        return None
    try:
        config = AutoConfig.from_pretrained(str(path), **({} if _local(path) else {"local_files_only": True}))
    except (OSError, ValueError):
        return None
    return tokenizer.get_vocab(), getattr(config, "vocab_size", None)


def check_vocab(student: str, teacher: str, tokenizers: dict | None = None) -> dict:
    """Raise IncompatibleModels on a vocabulary mismatch; returns what was compared.
    `tokenizers`: {path: tokenizer} from load_tokenizers (else they are loaded here)."""
    tokenizers = {**load_tokenizers(*(p for p in (student, teacher) if str(p) not in (tokenizers or {}))),
                  **(tokenizers or {})}  # the ones not passed in, loaded once each
    s, t = load_vocab(student, tokenizers[str(student)]), load_vocab(teacher, tokenizers[str(teacher)])
    if s is None or t is None:
        missing = student if s is None else teacher
        return {"checked": False, "reason": f"{missing} is not available locally (hub id not in the cache)"}
    (s_vocab, s_size), (t_vocab, t_size) = s, t
    if s_size != t_size:
        raise IncompatibleModels(f"vocab_size differs: student {student} has {s_size}, teacher {teacher} has {t_size}.")
    if s_vocab != t_vocab:
        diff = sorted(set(s_vocab.items()) ^ set(t_vocab.items()))[:5]
        raise IncompatibleModels(
            f"tokenizers differ between student {student} and teacher {teacher} "
            f"({len(s_vocab)} vs {len(t_vocab)} tokens; first differences: {diff}). Distill only between "
            "models that share a tokenizer."
        )
    return {"checked": True, "vocab_size": s_size, "tokens": len(s_vocab)}
