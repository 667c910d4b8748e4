"""Shared fixtures: the repository root and the embedded tiny models (built once, cached in .cache/)."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def embedded():
    """Paths of the tiny student, teacher, tokenizer and prompt parquet files that run.sh also uses."""
    from opd_patches.embedded.build import build

    return build(REPO / ".cache" / "embedded")
