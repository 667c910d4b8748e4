"""Evaluation statistics for pass@1 over sampled answers, with uncertainty that respects the question clustering.

Conventions (shared by every function here):

- A *results* mapping is ``{question_id: [outcome, ...]}``: one entry per question, one outcome per sampled
  answer, each 0/1 (or bool; floats in [0, 1] are accepted too, e.g. partial credit). Every question needs at
  least one sample.
- **pass@1** is the mean over questions of the per-question mean outcome: each question weighs the same,
  whatever its number of samples (a question sampled 16 times does not count 16 times more than one sampled
  once).
- **Uncertainty** is the *clustered* standard error: the samples of one question are not independent (they
  share its difficulty), so the unit of replication is the question. ``clustered_se = std(per-question means,
  ddof=1) / sqrt(n_questions)``. The naive binomial SE ``sqrt(p (1 - p) / n_samples)`` treats every sample as
  independent and understates the uncertainty; it is returned only as ``naive_binomial_se``, a labelled
  diagnostic, never as the uncertainty of a result.
- **Comparisons** (`paired_difference`) are paired by question: only questions present in both results
  count, the difference is taken per question (``mean_a - mean_b``), and its SE is ``std(per-question
  differences, ddof=1) / sqrt(n)``. The two-sided p-value comes from Student's t distribution with ``n - 1``
  degrees of freedom for ``t = diff / se`` (the paired t-test on per-question means), computed exactly for
  integer degrees of freedom by the closed-form series of Abramowitz & Stegun 26.7.3/26.7.4 (`t_two_sided_p`);
  for large ``n`` this is the normal approximation (`normal_two_sided_p`). The verdict says "within noise"
  unless both ``|diff| >= 2 * se`` and ``p < 0.05``.
- **Seeds** (`aggregate_seeds`): results of several seeds (independent evaluation runs) on the same questions
  are pooled per question (the question's mean over all its samples of all seeds) and the seed-to-seed spread
  is the std (ddof=1) of the per-seed pass@1.

Pure Python + numpy; this module imports nothing else, so it can be loaded by file path without the rest of
`opd_patches` (whose import pulls in VERL).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np

ALPHA = 0.05  # significance level of the verdict


def _question_means(results: Mapping, bounded: bool = True) -> dict:
    """``{question_id: (mean outcome, n samples)}``, validating the outcomes (in [0, 1] where ``bounded``, else
    finite)."""
    if not isinstance(results, Mapping):
        raise TypeError(f"results must map question_id -> list of outcomes, got {type(results).__name__}")
    out = {}
    for qid, outcomes in results.items():
        values = np.asarray([float(o) for o in outcomes], dtype=float)
        if values.size == 0:
            raise ValueError(f"question {qid!r} has no samples")
        if bounded and not np.all((values >= 0.0) & (values <= 1.0)):
            raise ValueError(f"question {qid!r} has outcomes outside [0, 1]: {values.tolist()}")
        if not np.all(np.isfinite(values)):
            raise ValueError(f"question {qid!r} has non-finite values: {values.tolist()}")
        out[qid] = (float(values.mean()), int(values.size))
    return out


def _clustered_se(values: np.ndarray) -> float:
    """std(values, ddof=1) / sqrt(n); nan when fewer than 2 values."""
    n = values.size
    if n < 2:
        return float("nan")
    return float(values.std(ddof=1) / math.sqrt(n))


def pass_at_1(results: Mapping) -> dict:
    """pass@1 of ``results`` (``{question_id: [0/1, ...]}``), each question weighted equally.

    Returns a dict:
    - ``mean``: mean over questions of the per-question mean outcome;
    - ``n_questions``, ``n_samples`` (all samples of all questions);
    - ``clustered_se``: std of the per-question means (ddof=1) / sqrt(n_questions) -- THE uncertainty of
      ``mean`` (nan with a single question);
    - ``naive_binomial_se``: sqrt(p (1 - p) / n_samples) with p the pooled sample mean -- a DIAGNOSTIC only
      (it assumes independent samples and understates the uncertainty); compare it with ``clustered_se`` to
      see how much clustering matters;
    - ``per_question``: ``{question_id: mean}``.
    """
    qm = _question_means(results)
    if not qm:
        raise ValueError("results has no questions")
    means = np.asarray([m for m, _ in qm.values()])
    counts = np.asarray([c for _, c in qm.values()])
    n_samples = int(counts.sum())
    pooled = float((means * counts).sum() / n_samples)
    return {
        "mean": float(means.mean()),
        "n_questions": int(means.size),
        "n_samples": n_samples,
        "clustered_se": _clustered_se(means),
        "naive_binomial_se": math.sqrt(pooled * (1.0 - pooled) / n_samples),
        "naive_binomial_se_note": "diagnostic only: assumes independent samples; use clustered_se",
        "per_question": {qid: m for qid, (m, _) in qm.items()},
    }


def truncation_rate(flags) -> float:
    """Fraction of samples that hit the length cap.

    ``flags`` is either a flat sequence of 0/1 (bool) flags, one per sample, or a results-like mapping
    ``{question_id: [flag, ...]}``; in both cases the rate is per SAMPLE (truncated samples / all samples),
    not per question.
    """
    if isinstance(flags, Mapping):
        values = [float(f) for fl in flags.values() for f in fl]
    else:
        values = [float(f) for f in flags]
    if not values:
        raise ValueError("no samples to compute a truncation rate from")
    return float(np.mean(values))


def normal_two_sided_p(z: float) -> float:
    """Two-sided p-value of a standard normal statistic: P(|Z| >= |z|) = erfc(|z| / sqrt(2))."""
    if math.isnan(z):
        return float("nan")
    return math.erfc(abs(z) / math.sqrt(2.0))


def t_two_sided_p(t: float, dof: int) -> float:
    """Two-sided p-value P(|T| >= |t|) of Student's t with integer ``dof`` >= 1, computed exactly.

    Abramowitz & Stegun 26.7.3 (odd dof) and 26.7.4 (even dof), with theta = atan(|t| / sqrt(dof)):
    A(t|dof) = P(|T| < |t|) is a finite series in sin/cos of theta, and p = 1 - A. The series has about
    dof / 2 terms; beyond 10^5 degrees of freedom the normal approximation is used (they agree to < 1e-5).
    Precision is absolute (about 1e-15), so p-values below ~1e-14 are only "about zero".
    """
    if math.isnan(t):
        return float("nan")
    dof = int(dof)
    if dof < 1:
        raise ValueError(f"t distribution needs dof >= 1, got {dof}")
    if math.isinf(t):
        return 0.0
    if dof > 100_000:
        return normal_two_sided_p(t)
    theta = math.atan(abs(t) / math.sqrt(dof))
    s, c = math.sin(theta), math.cos(theta)
    c2 = c * c
    if dof % 2 == 1:
        # A = (2/pi) (theta + sin(theta) [cos + (2/3) cos^3 + (2*4)/(3*5) cos^5 + ... + cos^(dof-2) term])
        series = 0.0
        if dof > 1:
            term = c
            series = term
            for k in range(3, dof - 1, 2):  # terms cos^k, k = 3, 5, ..., dof - 2
                term *= c2 * (k - 1) / k
                series += term
        a = (2.0 / math.pi) * (theta + s * series)
    else:
        # A = sin(theta) [1 + (1/2) cos^2 + (1*3)/(2*4) cos^4 + ... + cos^(dof-2) term]
        term = 1.0
        series = 1.0
        for k in range(2, dof - 1, 2):  # terms cos^k, k = 2, 4, ..., dof - 2
            term *= c2 * (k - 1) / k
            series += term
        a = s * series
    return float(min(1.0, max(0.0, 1.0 - a)))


def paired_difference(a: Mapping, b: Mapping, name_a: str = "a", name_b: str = "b", bounded: bool = True) -> dict:
    """Paired comparison of two results mappings on the questions they share (difference = a - b); outcomes
    in [0, 1], or any finite per-question values with ``bounded=False`` (e.g. a teacher-KL in nats).

    Questions present in only one of them are left out and counted (``only_in_a``, ``only_in_b``); no
    question in common is an error. Per question the difference of the mean outcomes is taken; then

    - ``diff``: mean of the per-question differences (= pass@1(a) - pass@1(b) on the common questions);
    - ``se``: std of the per-question differences (ddof=1) / sqrt(n) -- the clustered SE of ``diff``;
    - ``t`` = diff / se and ``p_value``: two-sided, Student's t with n - 1 dof (``p_method`` says which;
      exact series, see `t_two_sided_p`; close to the normal approximation for large n). Degenerate cases:
      n < 2 gives se = t = p = nan; se = 0 gives p = 1 when diff = 0, else p = 0;
    - ``verdict``: plain words -- "within noise" when |diff| < 2 se or p >= 0.05 (or undefined), else
      "<name> is better" naming the higher one.

    Also ``n_common``, ``mean_a``, ``mean_b`` (on the common questions), ``per_question`` differences.
    """
    qa, qb = _question_means(a, bounded), _question_means(b, bounded)
    common = [q for q in qa if q in qb]
    only_a = sum(1 for q in qa if q not in qb)
    only_b = sum(1 for q in qb if q not in qa)
    if not common:
        raise ValueError(
            f"paired_difference: {name_a} and {name_b} share no question ({only_a} only in {name_a}, "
            f"{only_b} only in {name_b}); a paired comparison needs the same questions"
        )
    da = np.asarray([qa[q][0] for q in common])
    db = np.asarray([qb[q][0] for q in common])
    d = da - db
    n = int(d.size)
    diff = float(d.mean())
    se = _clustered_se(d)
    if n < 2:
        t = p = float("nan")
    elif se == 0.0:
        t = 0.0 if diff == 0.0 else math.copysign(math.inf, diff)
        p = 1.0 if diff == 0.0 else 0.0
    else:
        t = diff / se
        p = t_two_sided_p(t, n - 1)
    if math.isnan(p):
        verdict = f"within noise (only {n} common question; no uncertainty estimate)"
    elif p >= ALPHA or abs(diff) < 2.0 * se:
        verdict = f"within noise ({name_a} - {name_b} = {diff:+.4f} +/- {se:.4f}, p = {p:.3g})"
    else:
        better, worse = (name_a, name_b) if diff > 0 else (name_b, name_a)
        verdict = f"{better} is better than {worse} ({name_a} - {name_b} = {diff:+.4f} +/- {se:.4f}, p = {p:.3g})"
    return {
        "diff": diff,
        "se": se,
        "t": t,
        "p_value": p,
        "p_method": f"two-sided Student t, {n - 1} dof (paired by question)" if n >= 2 else "undefined (n < 2)",
        "verdict": verdict,
        "n_common": n,
        "only_in_a": only_a,
        "only_in_b": only_b,
        "mean_a": float(da.mean()),
        "mean_b": float(db.mean()),
        "per_question": {q: float(x) for q, x in zip(common, d)},
    }


def aggregate_seeds(list_of_results: Sequence[Mapping] | Iterable[Mapping]) -> dict:
    """Pool results of several seeds on the same questions and report the seed-to-seed spread.

    Every seed must cover the same question set (else ValueError: per-seed means on different questions
    are not comparable). Returns:
    - ``pooled``: `pass_at_1` of the pooled results (per question, all samples of all seeds together, so
      its ``clustered_se`` is across questions with the seeds pooled);
    - ``pooled_results``: the pooled ``{question_id: [outcomes...]}``;
    - ``mean``: ``pooled["mean"]``;
    - ``per_seed_means``: pass@1 of each seed;
    - ``seed_std``: std of the per-seed means (ddof=1; nan for one seed) -- the seed-to-seed spread;
    - ``seed_se``: seed_std / sqrt(n_seeds), the spread of the mean over seeds;
    - ``n_seeds``.
    """
    seeds = list(list_of_results)
    if not seeds:
        raise ValueError("aggregate_seeds needs at least one seed")
    keys = set(seeds[0])
    for i, r in enumerate(seeds[1:], start=1):
        if set(r) != keys:
            raise ValueError(
                f"seed {i} covers different questions than seed 0 ({len(set(r) - keys)} extra, "
                f"{len(keys - set(r))} missing)"
            )
    per_seed = [pass_at_1(r)["mean"] for r in seeds]
    pooled_results = {q: [o for r in seeds for o in r[q]] for q in seeds[0]}
    pooled = pass_at_1(pooled_results)
    k = len(seeds)
    seed_std = float(np.std(per_seed, ddof=1)) if k >= 2 else float("nan")
    return {
        "pooled": pooled,
        "pooled_results": pooled_results,
        "mean": pooled["mean"],
        "per_seed_means": per_seed,
        "seed_std": seed_std,
        "seed_se": seed_std / math.sqrt(k) if k >= 2 else float("nan"),
        "n_seeds": k,
    }
