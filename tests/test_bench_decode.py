"""The decode phase's CPU-checkable parts (the phase itself needs vLLM and a GPU: docs/architecture.md)."""

import pytest

from tools.bench import decode, run


def test_train_rate_over_the_window_and_after_warm_up():
    ends = [10.0, 10.5, 11.0, 11.5, 12.5, 13.5]
    assert decode.train_rate(ends) == pytest.approx((13.5 - 10.5) / 4)  # the first iteration is warm-up
    assert decode.train_rate(ends, (11.2, 13.6)) == pytest.approx(1.0)  # 11.5, 12.5, 13.5
    assert decode.train_rate(ends, (12.0, 13.0)) is None  # one iteration in the window: no rate


def test_decode_is_a_registered_phase_with_its_arguments(tmp_path, monkeypatch):
    seen = {}

    def fake_phase(size, args):  # stands in for the GPU work: what the CLI hands the phase
        seen.update(batches=args.batches, tokens=args.tokens, shares=args.train_shares, share_batches=args.share_batches)
        return {"size": size.name, "rows": []}

    assert run.PHASES["decode"] == "tools.bench.decode:run_phase"
    monkeypatch.setitem(run.PHASES, "decode", f"{__name__}:_fake")
    globals()["_fake"] = fake_phase
    out = tmp_path / "b.json"
    assert run.main(["--phase", "decode", "--size", "cpu", "--out", str(out), "--batches", "8", "16",
                     "--tokens", "64", "--train-shares", "25", "--share-batches", "16", "8"]) == 0
    assert seen == {"batches": [8, 16], "tokens": 64, "shares": [25], "share_batches": [16, 8]}
    assert out.exists()
