"""opd_patches.eval.stats: pass@1 with clustered SE, paired comparisons, seed aggregation (hand-computed cases)."""

import math

import pytest

from opd_patches.eval import stats

# Hand-worked example: 3 questions, different sample counts.
A = {"q1": [1, 1, 0, 0], "q2": [1, 1, 1, 1], "q3": [0, 0]}  # per-question means 0.5, 1.0, 0.0
B = {"q1": [0, 0, 0, 0], "q2": [True, False], "q3": [0, 0]}  # per-question means 0.0, 0.5, 0.0


def test_pass_at_1_hand_computed():
    r = stats.pass_at_1(A)
    # mean of (0.5, 1, 0) = 0.5; deviations (0, .5, -.5) -> var(ddof=1) = 0.5/2 = 0.25 -> std 0.5
    assert r["mean"] == pytest.approx(0.5)
    assert r["n_questions"] == 3 and r["n_samples"] == 10
    assert r["clustered_se"] == pytest.approx(0.5 / math.sqrt(3))
    # diagnostic: pooled 6/10 = 0.6 -> sqrt(0.6*0.4/10)
    assert r["naive_binomial_se"] == pytest.approx(math.sqrt(0.024))
    assert "diagnostic" in r["naive_binomial_se_note"]
    assert r["per_question"] == {"q1": 0.5, "q2": 1.0, "q3": 0.0}


def test_questions_weighted_equally():
    # q1: 1 sample correct; q2: 9 samples wrong. Equal weights -> 0.5, not the sample-weighted 0.1.
    r = stats.pass_at_1({"q1": [1], "q2": [0] * 9})
    assert r["mean"] == pytest.approx(0.5)
    assert r["n_samples"] == 10


def test_pass_at_1_validation():
    with pytest.raises(ValueError):
        stats.pass_at_1({})
    with pytest.raises(ValueError):
        stats.pass_at_1({"q": []})
    with pytest.raises(ValueError):
        stats.pass_at_1({"q": [2]})
    assert math.isnan(stats.pass_at_1({"q": [1, 0]})["clustered_se"])


def test_truncation_rate():
    assert stats.truncation_rate([1, 0, 0, 0]) == pytest.approx(0.25)
    assert stats.truncation_rate({"q1": [True, False], "q2": [False] * 6}) == pytest.approx(1 / 8)
    with pytest.raises(ValueError):
        stats.truncation_rate([])


@pytest.mark.parametrize(
    "t,dof,p",
    [
        (1.0, 1, 0.5),  # Cauchy: P(|T| >= 1) = 1/2
        (12.706204736, 1, 0.05),  # t_{0.975, 1}
        (4.302652730, 2, 0.05),  # t_{0.975, 2}
        (2.0, 2, 1 - 2 / math.sqrt(6)),  # dof 2: p = 1 - t / sqrt(2 + t^2)
        (math.sqrt(3), 3, 0.5 - 1 / math.pi),  # theta = pi/4
        (2.776445105, 4, 0.05),  # t_{0.975, 4}
        (2.228138852, 10, 0.05),  # t_{0.975, 10}
        (2.042272456, 30, 0.05),  # t_{0.975, 30}
        (0.0, 7, 1.0),
        (-2.0, 2, 1 - 2 / math.sqrt(6)),  # symmetric
    ],
)
def test_t_two_sided_p_known_values(t, dof, p):
    assert stats.t_two_sided_p(t, dof) == pytest.approx(p, abs=1e-8)


def test_normal_p_and_large_dof():
    assert stats.normal_two_sided_p(1.959963985) == pytest.approx(0.05, abs=1e-9)
    assert stats.normal_two_sided_p(2.575829304) == pytest.approx(0.01, abs=1e-9)
    # t converges to the normal
    assert stats.t_two_sided_p(1.959963985, 20_000) == pytest.approx(0.05, abs=1e-4)
    assert stats.t_two_sided_p(1.959963985, 10**6) == pytest.approx(0.05, abs=1e-6)


def test_paired_difference_hand_computed():
    r = stats.paired_difference(A, B, "A", "B")
    # per-question differences (0.5, 0.5, 0); mean 1/3; deviations (1/6, 1/6, -1/3) -> sum sq 1/6,
    # var(ddof=1) 1/12, std 1/sqrt(12), se = 1/sqrt(12)/sqrt(3) = 1/6; t = 2 with 2 dof
    assert r["diff"] == pytest.approx(1 / 3)
    assert r["se"] == pytest.approx(1 / 6)
    assert r["t"] == pytest.approx(2.0)
    assert r["p_value"] == pytest.approx(1 - 2 / math.sqrt(6))  # 0.1835
    assert r["n_common"] == 3 and r["only_in_a"] == 0 and r["only_in_b"] == 0
    assert r["mean_a"] == pytest.approx(0.5) and r["mean_b"] == pytest.approx(1 / 6)
    assert r["verdict"].startswith("within noise")
    assert "2 dof" in r["p_method"]


def test_paired_difference_identical_inputs():
    r = stats.paired_difference(A, A)
    assert r["diff"] == 0.0 and r["se"] == 0.0
    assert r["p_value"] == 1.0
    assert r["verdict"].startswith("within noise")


def test_paired_difference_disjoint_questions_is_an_error():
    with pytest.raises(ValueError, match="share no question"):
        stats.paired_difference({"q1": [1]}, {"q2": [0]})


def test_paired_difference_uses_common_questions_only():
    b = dict(B)
    b["extra1"] = [1]
    b["extra2"] = [0]
    a = dict(A)
    a["only_a"] = [1, 1]
    r = stats.paired_difference(a, b)
    assert r["n_common"] == 3 and r["only_in_a"] == 1 and r["only_in_b"] == 2
    assert r["diff"] == pytest.approx(1 / 3)


def test_paired_difference_large_clear_difference():
    good = {f"q{i}": ([1, 1, 1, 0] if i % 5 == 0 else [1, 1, 1, 1]) for i in range(50)}
    bad = {f"q{i}": ([0, 0, 1, 1] if i % 3 == 0 else [0, 0, 0, 1]) for i in range(50)}
    r = stats.paired_difference(good, bad, "student_opd", "baseline")
    assert r["diff"] > 0.5
    assert r["p_value"] < 0.01
    assert abs(r["diff"]) >= 2 * r["se"]
    assert r["verdict"].startswith("student_opd is better than baseline")
    r2 = stats.paired_difference(bad, good, "baseline", "student_opd")
    assert r2["diff"] == pytest.approx(-r["diff"])
    assert r2["p_value"] == pytest.approx(r["p_value"])
    assert r2["verdict"].startswith("student_opd is better than baseline")


def test_paired_difference_single_question_is_within_noise():
    r = stats.paired_difference({"q": [1]}, {"q": [0]})
    assert math.isnan(r["se"]) and math.isnan(r["p_value"])
    assert r["verdict"].startswith("within noise")


def test_aggregate_seeds():
    s1 = {"q1": [1, 1], "q2": [0, 0]}  # pass@1 0.5
    s2 = {"q1": [1, 0], "q2": [0, 0]}  # 0.25
    s3 = {"q1": [1, 1], "q2": [1, 1]}  # 1.0
    r = stats.aggregate_seeds([s1, s2, s3])
    assert r["n_seeds"] == 3
    assert r["per_seed_means"] == pytest.approx([0.5, 0.25, 1.0])
    # mean of per-seed means 7/12; deviations (-1/12, -4/12, 5/12) -> sum sq 42/144, var 21/144
    assert r["seed_std"] == pytest.approx(math.sqrt(21) / 12)
    assert r["seed_se"] == pytest.approx(math.sqrt(21) / 12 / math.sqrt(3))
    assert r["pooled_results"]["q1"] == [1, 1, 1, 0, 1, 1]
    # pooled per question: q1 5/6, q2 2/6 -> mean 7/12 (equal samples per seed: = mean of seed means)
    assert r["mean"] == pytest.approx(7 / 12)
    assert r["pooled"]["n_samples"] == 12
    assert math.isnan(stats.aggregate_seeds([s1])["seed_std"])
    with pytest.raises(ValueError):
        stats.aggregate_seeds([s1, {"q1": [1]}])
    with pytest.raises(ValueError):
        stats.aggregate_seeds([])


def test_paired_difference_of_unbounded_values_only_when_asked():
    a, b = {"q1": [2.5], "q2": [0.5], "q3": [1.5]}, {"q1": [2.0], "q2": [0.0], "q3": [2.0]}
    with pytest.raises(ValueError, match="outside"):
        stats.paired_difference(a, b)  # pass@1 outcomes: a KL in nats is refused by default
    d = stats.paired_difference(a, b, bounded=False)
    assert d["diff"] == pytest.approx((0.5 + 0.5 - 0.5) / 3) and d["n_common"] == 3
    assert d["se"] == pytest.approx(math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2) / math.sqrt(3))
    with pytest.raises(ValueError, match="non-finite"):
        stats.paired_difference({**a, "q4": [float("inf")]}, b, bounded=False)
