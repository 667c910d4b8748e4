"""The statistics of tools/spec_exactness.py (the GPU check that speculation keeps the sampling distribution),
against closed forms and on samples whose distributions are known."""

import json
import math
import random
from collections import Counter

import pytest

from tools import spec_exactness as se


@pytest.mark.parametrize("x", [0.1, 1.0, 3.841, 9.21, 20.0])
def test_chi2_survival_matches_the_closed_forms(x):
    assert se.chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)  # df 2: exponential
    assert se.chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)  # df 1: squared normal


def chain(rng: random.Random, n: int, length: int, tilt: dict | None = None) -> list[list[int]]:
    """Sequences of a fixed Markov chain over 6 tokens (token 5 ends a sequence); `tilt` {position: (token, q)}:
    at that position the token is replaced by `token` with probability q (a biased sampler)."""
    table = {s: [(s * 7 + t * 3) % 11 + 1 for t in range(6)] for s in range(-1, 6)}
    out = []
    for _ in range(n):
        seq, state = [], -1
        for pos in range(1, length + 1):
            token = rng.choices(range(6), weights=table[state])[0]
            if tilt and pos in tilt and rng.random() < tilt[pos][1]:
                token = tilt[pos][0]
            seq.append(token)
            if token == 5:
                break
            state = token
        out.append(seq)
    return out


def test_two_samples_of_one_sampler_pass_and_the_planted_bias_is_rejected():
    plain, spec = chain(random.Random(1), 2000, 8), chain(random.Random(2), 2000, 8)
    result = se.compare({"q": plain}, {"q": spec}, [2, 3, 4, 8], alpha=0.01, bias=0.2, min_shift=0.1)
    assert result["exact"], min(t["p"] for t in result["tests"])
    assert result["level_per_test"] == pytest.approx(0.01 / 4)
    assert result["planted_tests"] >= 2 and result["planted_rejected"], result["planted"]
    for t in result["planted"]:
        # bias x the share moved: off a top token that holds half or more, else onto it
        top_share = max(Counter(se.token_at(spec, t["position"])).values()) / len(spec)
        assert t["shift"] == pytest.approx(0.2 * (top_share if top_share >= 0.5 else 1 - top_share))


def peaked(rng: random.Random, n: int, length: int, top_share: float) -> list[list[int]]:
    """Sequences whose every token is 0 with probability `top_share`, else 1, 2 or 3: a trained model's peak."""
    return [[0 if rng.random() < top_share else rng.choice([1, 2, 3]) for _ in range(length)] for _ in range(n)]


def test_the_planted_bias_moves_mass_off_the_top_token_where_the_model_is_peaked():
    """Moving samples onto a token that already holds 90 % would shift a tenth of the bias; moving them off it
    shifts bias x 0.9. A position where one token holds every sample gets a token never seen there."""
    plain, spec = peaked(random.Random(1), 4000, 8, 0.9), peaked(random.Random(2), 4000, 8, 0.9)
    result = se.compare({"q": plain}, {"q": spec}, [2, 4, 8], alpha=0.01, bias=0.2, min_shift=0.1)
    assert result["exact"]
    assert [round(t["shift"], 2) for t in result["planted"]] == [pytest.approx(0.18, abs=0.01)] * 3
    assert result["planted_tests"] == 3 and result["planted_rejected"]
    biased, _ = se.plant_bias(spec, [2], 0.2)
    assert Counter(se.token_at(biased, 2))[0] / 4000 == pytest.approx(0.9 * 0.8, abs=0.02)
    certain = [[0] + s[1:] for s in spec]
    result = se.compare({"q": certain}, {"q": certain}, [1, 2], alpha=0.01, bias=0.2, min_shift=0.1)
    assert [t["shift"] for t in result["planted"]][0] == 0.2 and result["planted_rejected"]


def test_reuse_tests_the_kept_samples_again_without_an_engine(tmp_path, capsys):
    out = tmp_path / "exactness.json"
    assert se.main(["--reuse", "--out", str(out)]) == 2  # nothing kept yet
    assert "missing" in capsys.readouterr().err
    counters = {"drafted": 40.0, "accepted": 25.0}
    for engine, seed in (("plain", 1), ("spec", 2)):
        drawn = {"samples": {"q": chain(random.Random(seed), 2000, 8)}, "counters": counters,
                 "spec": se.NGRAM if engine == "spec" else None}
        out.with_suffix(f".{engine}.json").write_text(json.dumps(drawn))
    assert se.main(["--reuse", "--out", str(out), "--positions", "2,3,4"]) == 0
    result = json.loads(out.read_text())
    assert result["exact"] and result["planted_rejected"] and result["exercised"]
    assert result["samples"] == 2000 and result["prompts"] == 1 and len(result["tests"]) == 3
    assert result["spec"] == se.NGRAM
    drawn["samples"] = {"another question": drawn["samples"]["q"]}
    out.with_suffix(".spec.json").write_text(json.dumps(drawn))
    assert se.main(["--reuse", "--out", str(out)]) == 2
    assert "different prompts" in capsys.readouterr().err


def test_a_compilation_setting_is_checked_alone_without_drafts(tmp_path):
    """`--spec none`: the checked engine drafts nothing, so no drafts are asked for; its samples must still match
    the plain engine's, and an engine whose late requests come out flatter (as full CUDA graphs over mixed
    batches gave) fails."""
    out = tmp_path / "exactness.json"
    none = {"drafted": 0.0, "accepted": 0.0}

    def keep(plain, checked):
        for engine, samples in (("plain", plain), ("spec", checked)):
            out.with_suffix(f".{engine}.json").write_text(json.dumps({"samples": {"q": samples}, "counters": none,
                                                                      "spec": None}))

    keep(chain(random.Random(1), 2000, 8), chain(random.Random(2), 2000, 8))
    assert se.main(["--reuse", "--out", str(out), "--positions", "2,3,4,8"]) == 0
    assert json.loads(out.read_text())["exercised"] is None
    flat = chain(random.Random(2), 1600, 8) + [[random.Random(i).randrange(6) for _ in range(8)] for i in range(400)]
    keep(chain(random.Random(1), 2000, 8), flat)
    assert se.main(["--reuse", "--out", str(out), "--positions", "2,3,4,8"]) == 1
    assert not json.loads(out.read_text())["exact"]


def test_a_sampler_off_at_one_position_is_caught():
    """A speculative sampler that keeps a drafted token too often (here token 2 at position 4, 15 % of the time)."""
    plain, spec = chain(random.Random(1), 2000, 8), chain(random.Random(2), 2000, 8, tilt={4: (2, 0.15)})
    result = se.compare({"q": plain}, {"q": spec}, [2, 3, 4, 8], alpha=0.01, bias=0.2, min_shift=0.1)
    assert not result["exact"]
    assert [t["position"] for t in result["tests"] if t["p"] <= result["level_per_test"]] == [4]


def test_the_rarest_tokens_share_one_cell_and_ended_samples_count_as_their_own_category():
    a = [1] * 50 + [2] * 50 + [3] * 6 + [5] * 3
    b = [1] * 50 + [2] * 50 + [4] * 6 + [5] * 3
    r = se.homogeneity(a, b)
    assert r["df"] == 2 and r["p"] > 0.9  # {1}, {2} and the rest {3, 4, 5}
    assert se.homogeneity(a, b, max_cells=2)["df"] == 1  # {1} and the rest
    few = se.homogeneity([1] * 50 + [2] * 50 + [3], [1] * 50 + [2] * 50 + [4])
    assert few["df"] == 1  # the rest expects under 5 in each: merged into the smallest kept cell
    assert se.token_at([[7, 8], [7]], 2) == [8, "end"]
    assert se.homogeneity([1] * 10, [1] * 10) == {"stat": 0.0, "df": 0, "p": 1.0}
