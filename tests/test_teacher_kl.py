"""The teacher-KL estimator (opd_patches/eval/teacher_kl.py) against references computed here: each row
alone, unpadded, with a plain full-vocabulary KL; zero for a model against itself; the positions it scores."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from opd_patches.eval import teacher_kl
from opd_patches.embedded.addition import questions

import conftest


def _models(embedded, tmp_path):
    s = AutoModelForCausalLM.from_pretrained(conftest.sharpened(embedded["student"], tmp_path / "s", 1)).eval()
    t = AutoModelForCausalLM.from_pretrained(conftest.sharpened(embedded["teacher"], tmp_path / "t", 2)).eval()
    return s, t


def _row_kl(s, t, seq, start, vocab):
    """KL(p_S || p_T) of each token from `start` on, one unpadded row, from first principles."""
    with torch.no_grad():
        ls = torch.log_softmax(s(input_ids=seq[None]).logits[0, :, :vocab].double(), -1)
        lt = torch.log_softmax(t(input_ids=seq[None]).logits[0, :, :vocab].double(), -1)
    kl = (ls.exp() * (ls - lt)).sum(-1)
    return kl[start - 1: len(seq) - 1]  # the distribution at i predicts token i+1


def test_padded_batch_equals_each_row_alone(embedded, tmp_path):
    s, t = _models(embedded, tmp_path)
    vocab = 448
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (5, 9, 3)]
    responses = [torch.randint(3, vocab, (n,), generator=g) for n in (4, 4, 4)]
    width = max(map(len, prompts))
    ids = torch.zeros((3, width + 4), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (p, y) in enumerate(zip(prompts, responses)):
        ids[r, width - len(p): width] = p
        ids[r, width:] = y
        mask[r, width - len(p):] = 1
    with torch.no_grad():
        got = teacher_kl._kl(s, t, ids, mask, width, vocab)
    for r, (p, y) in enumerate(zip(prompts, responses)):
        want = _row_kl(s, t, torch.cat([p, y]), len(p), vocab)
        torch.testing.assert_close(got[r].double(), want, rtol=1e-4, atol=1e-5)
    assert (got >= -1e-6).all() and got.sum() > 0


def test_zero_against_itself_and_counts_each_response_token(embedded, tmp_path):
    qs = questions(6)
    same = teacher_kl.measure(embedded["student"], embedded["student"], qs, samples=2, max_new_tokens=8)
    assert same["teacher_kl"] == 0.0 and same["n_samples"] == 12 and same["n_questions"] == 6
    assert 12 <= same["n_tokens"] <= 12 * 8
    other = teacher_kl.measure(embedded["student"], embedded["teacher"], qs, samples=2, max_new_tokens=8)
    assert other["n_tokens"] == same["n_tokens"]  # the same fresh samples: the student's, same seeds
    assert other["teacher_kl"] > 0 and other["se_clustered"] > 0
    means = list(other["per_question"].values())  # each question's mean: their spread is the clustered SE
    assert sorted(other["per_question"]) == sorted(q["id"] for q in qs) and min(means) >= 0
    mu = sum(means) / len(means)
    assert other["se_clustered"] == pytest.approx(math.sqrt(sum((m - mu) ** 2 for m in means) / 5 / 6))
