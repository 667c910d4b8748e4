"""tools/bench/suffix_cache.py feeds arctic-inference's suffix cache as vLLM's proposer does: every response stays
cached, and random text costs the tree more memory per token than a repetition loop (where arctic-inference is
installed: docs/speculation.md, Installing suffix); without it the tool says what it needs."""

import sys

import pytest

from tools.bench import suffix_cache


def test_random_text_costs_the_tree_more_than_a_loop():
    pytest.importorskip("arctic_inference", reason="needs arctic-inference: see docs/speculation.md, Installing suffix")
    random_row = suffix_cache.measure(20, 2000, 24, 151665, "random")
    loop_row = suffix_cache.measure(20, 2000, 24, 151665, "loop")
    assert random_row["responses"] == loop_row["responses"] == 20
    assert random_row["rss_growth_bytes"] > 4 * max(loop_row["rss_growth_bytes"], 1 << 20)


def test_without_arctic_inference_it_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "arctic_inference", None)  # an import of it now fails, installed or not
    assert suffix_cache.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs arctic-inference" in capsys.readouterr().err
