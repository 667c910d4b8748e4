"""`Completion`: what every evaluation backend returns per prompt (its own module, so that `backends`
can import the vLLM backend lazily without the vLLM backend importing `backends` back)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Completion:
    text: str
    n_tokens: int
    finish_reason: str  # "stop" | "length" (hit max_new_tokens without an EOS)
