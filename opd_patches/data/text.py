"""Problem-text normalisation and word n-grams (de-duplication and decontamination share them).

`normalize(text)`: Unicode NFKC, lower case, `\\dfrac`/`\\tfrac` -> `\\frac`, `\\left`/`\\right`
dropped, math delimiters (`$`, `\\(`, `\\)`, `\\[`, `\\]`) and LaTeX spacing commands (`\\,` `\\;`
`\\!` `\\:` `\\ `) turned into spaces, whitespace runs collapsed. `key(text)`: the same without any
whitespace; two problems are duplicates (and a training problem an exact copy of an evaluation
problem) when their keys are equal, so `$x$, y` and `x,y` are the same text.

`words(text)`: the normalised text's runs of letters and runs of digits (`\\frac{1}{2}` gives
`frac 1 2`): punctuation and LaTeX markup do not count, numbers do (a changed number breaks the
n-grams around it). `ngrams(text, n)`: the set of word n-grams; empty when the text has fewer than
`n` words.
"""

from __future__ import annotations

import re
import unicodedata

_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![a-z])")
_DELIMITERS_RE = re.compile(r"\$|\\[()\[\],;:! ]")
_SPACE_RE = re.compile(r"\s+")
_WORD_RE = re.compile(r"[a-z]+|\d+")


def normalize(text: str) -> str:
    s = unicodedata.normalize("NFKC", str(text)).lower()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT_RE.sub("", s)
    s = _DELIMITERS_RE.sub(" ", s)
    return _SPACE_RE.sub(" ", s).strip()


def key(text: str) -> str:
    return normalize(text).replace(" ", "")


def words(text: str) -> list[str]:
    return _WORD_RE.findall(normalize(text))


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}
