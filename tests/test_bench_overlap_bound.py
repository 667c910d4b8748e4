"""The overlap model (tools/bench/overlap_bound.py): hand-computed cases and its bounds."""

import length_stats
import pytest

from tools.bench import overlap_bound as ob


def test_a_hand_computed_step():
    # Two sequences of 50 and 100 tokens, 1 s of decode (10 ms a step), 1 s of work split 1/3 : 2/3 by tokens.
    # Free sharing: the short one's 1/3 s runs beside decode after token 50 (t = 0.5 s); the long one's 2/3 s
    # after decode ends at 1.0 s -> 1.6667 s against 2 s sequential.
    assert ob.overlapped_step([50, 100], 1.0, 1.0, 1.0, 1.0) == pytest.approx(1 + 2 / 3)
    # Decode twice as slow beside training, training at half rate: the 1/3 s takes 2/3 s from t = 0.5 s, while
    # decode covers 1/3 s of its own time; the remaining 1/6 s of decode alone: 0.5 + 2/3 + 1/6 + 2/3.
    assert ob.overlapped_step([50, 100], 1.0, 1.0, 2.0, 2.0) == pytest.approx(0.5 + 2 / 3 + 1 / 6 + 2 / 3)


def test_nothing_overlaps_when_every_response_runs_to_the_cap():
    rows = ob.bound("cap", 20.0, 8.0, 32, 7168, 2, ob.MEASURED)
    assert all(r["ratio"] == pytest.approx(1.0) for r in rows)


def test_free_sharing_bounds_every_measured_mechanism():
    rows = {r["share"]: r for r in ob.bound("seed-math500", 19.9, 8.05, 32, 7168, 20, ob.MEASURED)}
    ideal = rows["ideal"]["ratio"]
    assert 0.5 < ideal < 1.0
    assert all(r["ratio"] >= ideal for r in rows.values())
    assert rows["time-sliced"]["ratio"] > 1.0  # decode slowed 2.6x for 1.8x of training: worse than in turn


def test_lengths_follow_the_named_profile():
    """One batch of 4,000 lengths follows the profile's log-normal at the cap (tests/length_stats.py)."""
    got = ob.draw_lengths("seed-math500", 4000, 7168, 0)
    assert max(got) == 7168
    length_stats.assert_follows("seed-math500", got, 7168)
