"""tools/bench/suffix_cache.py feeds arctic-inference's suffix cache as vLLM's proposer does: every response stays
cached, and random text costs the tree more memory per token than a repetition loop. Runs where arctic-inference
is installed (docs/speculation.md, Installing suffix)."""

import pytest

pytest.importorskip("arctic_inference", reason="needs arctic-inference: see docs/speculation.md, Installing suffix")

from tools.bench import suffix_cache  # noqa: E402


def test_random_text_costs_the_tree_more_than_a_loop():
    random_row = suffix_cache.measure(20, 2000, 24, 151665, "random")
    loop_row = suffix_cache.measure(20, 2000, 24, 151665, "loop")
    assert random_row["responses"] == loop_row["responses"] == 20
    assert random_row["rss_growth_bytes"] > 4 * max(loop_row["rss_growth_bytes"], 1 << 20)


def test_main_refuses_without_arctic(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "arctic_inference" else real(name, *a, **k))
    assert suffix_cache.main(["--out", str(tmp_path / "x.json")]) == 2
