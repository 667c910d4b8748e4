"""The training teaches: `make learn`'s study (recipes/studies/learn.yaml) on the known-answer task, run
end to end as one study per arm (the task built from scratch, real VERL trainer, hf rollout, colocated
teacher, exports evaluated by the project's evaluation), then each study's summary.json checked.

Bounds (one seed, 200 held-out questions x 4 samples at T=1; the measurements behind them are in
docs/learning.md):
- the task: student pass@1 <= 0.2, teacher >= 0.8 on the study's own evaluation of both (the build's
  evaluation is held to the same bounds by the build itself: opd_patches/embedded/addition.py);
- topk: pass@1 up by >= 0.3 absolute and by >= 3 question-clustered SE (paired by question against the
  student), held-out teacher-KL cut by >= 50 %;
- k1 (policy gradient on a one-sample estimate: slower by design): pass@1 up by >= K1_MIN_GAIN and >= 2 SE,
  teacher-KL cut by >= K1_MIN_KL_CUT.
A bug that breaks the teaching signal fails these: see the planted-bug record in docs/learning.md
(advantage sign, teacher log-probs shifted by a position, the update's mask widened to the prompt).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from background import Spec, shared_run

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "recipes" / "studies" / "learn.yaml"
ARMS = ("k1", "topk")  # topk_tail: `make learn`; its maths is checked against references in test_tail_kl.py
# The suite's cut of `make learn` (time: these are the longest runs of `make test`): one study per arm, so
# that the two trainings can run side by side in the pool's two slots (each evaluates the student itself: the
# gains are paired within a study); topk at 2 samples per prompt (64 a step; +0.371 at step 80 measured,
# docs/learning.md), steps 40 and 80 evaluated; k1 at the overlay's 4 (with 2 it did not move in 80 steps)
# for 60 steps (+0.0975 at step 60, as much as at 80; the learning rate is constant after its warm-up, so a
# 60-step run is the first 60 steps of make learn's), only its last step evaluated.
# Both arms at 64-token prompts and 48-token responses (padding 112), the lengths these bounds were measured
# and CI-passed at; make learn's overlay pads to 72 (40 + 32) for time. At 72, topk at 2 samples per prompt
# reached +0.281 in one fresh-clone run (+0.371 at 112): two samples per prompt is the noisier cut.
LENGTHS = ["data.max_prompt_length=64", "data.max_response_length=48"]
ARM_OVERRIDES = {"k1": LENGTHS, "topk": ["actor_rollout_ref.rollout.n=2"] + LENGTHS}
REFERENCES = {"k1": ("student",), "topk": ("student", "teacher")}
STEPS = {"k1": 60, "topk": 80}
CHECKPOINTS = {"k1": [60], "topk": [40, 80]}
TOPK_MIN_GAIN, TOPK_MIN_SE, TOPK_MIN_KL_CUT = 0.3, 3.0, 0.5
# about half of what k1 showed at step 60: +0.0975 (4.4 SE), teacher-KL -31 %
K1_MIN_GAIN, K1_MIN_SE, K1_MIN_KL_CUT = 0.05, 2.0, 0.1
pytestmark = pytest.mark.slow


def _learn_spec(arm: str):
    def make(base: Path) -> Spec:
        spec = yaml.safe_load(SPEC.read_text())
        spec["arms"] = {arm: spec["arms"][arm] + ARM_OVERRIDES.get(arm, [])}
        spec["control"] = arm
        spec["references"] = {name: spec["references"][name] for name in REFERENCES[arm]}
        spec["budget"]["steps"] = STEPS[arm]
        spec["eval"]["checkpoints"] = CHECKPOINTS[arm]
        (base / "learn.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))

        def build(out):  # the task's assets, built first as `make learn` does (cached in .cache/addition, under
            # a lock: both runs call it). A child process: its progress lines go to its log, not into the output
            # that a test running meanwhile captures, and its training does not share this process's GIL.
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "build.log", "w") as log:
                code = subprocess.run([sys.executable, "-m", "opd_patches.embedded", "--task", "addition",
                                       "--out", str(REPO / ".cache" / "addition")], cwd=REPO, stdout=log,
                                      stderr=subprocess.STDOUT).returncode
            assert code == 0, (out / "build.log").read_text()[-4000:]

        return Spec(argv=[sys.executable, "-m", "opd_patches.study", str(base / "learn.yaml"), "--out", str(base / "learn")],
                    timeout=2400, prepare=build)
    return make


# k1 (the longest) starts first and builds the task on a fresh clone; topk is queued behind study_run (cost
# 4), which fills the other slot meanwhile instead of waiting on the build's lock.
learn_k1 = shared_run("learn_k1", _learn_spec("k1"), cost=6)
learn_topk = shared_run("learn_topk", _learn_spec("topk"), cost=3.5)


def _summary(run) -> dict:
    path = run.out / "learn" / "summary.json"
    assert run.returncode == 0 and path.exists(), run.log[-4000:]
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def summary(learn_k1, learn_topk):
    """Both studies' summary.json as one: the references of the topk study, the arms of both."""
    k1, topk = _summary(learn_k1), _summary(learn_topk)
    assert k1["student"] == topk["student"]  # the same evaluation (seeded) of the same student
    return {**topk, "arms": {**k1["arms"], **topk["arms"]}, "runs": {"k1": learn_k1, "topk": learn_topk},
            "steps": {"k1": k1["steps"], "topk": topk["steps"]}}


def test_the_task_has_a_teacher_that_knows_and_a_student_that_does_not(summary):
    assert summary["student"]["pass_at_1"] <= 0.2
    assert summary["teacher"]["pass_at_1"] >= 0.8
    assert summary["student"]["teacher_kl"] > 0 and summary["teacher"]["teacher_kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("arm, min_gain, min_se, min_cut", [
    ("topk", TOPK_MIN_GAIN, TOPK_MIN_SE, TOPK_MIN_KL_CUT),
    ("k1", K1_MIN_GAIN, K1_MIN_SE, K1_MIN_KL_CUT),
])
def test_the_student_moves_toward_the_teacher(summary, arm, min_gain, min_se, min_cut):
    a = summary["arms"][arm]
    gain, kl = a["gain"], a["teacher_kl"]
    shown = json.dumps({k: a[k] for k in ("step", "pass_at_1", "gain", "teacher_kl")})
    assert a["step"] == summary["steps"][arm] == STEPS[arm], shown
    assert gain["diff"] >= min_gain and gain["diff"] >= min_se * gain["se"], shown
    assert kl["end"] <= (1 - min_cut) * kl["start"], shown


def test_curves_and_report_are_written(summary):
    for arm in ARMS:
        out, run = summary["runs"][arm].out / "learn", summary["runs"][arm]
        steps = [c["step"] for c in summary["arms"][arm]["curve"]]
        assert steps == [0, *CHECKPOINTS[arm]] and CHECKPOINTS[arm][-1] == summary["steps"][arm]
        assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "## References on addition" in (out / "report.md").read_text()
        assert "teacher-KL" in run.log  # the table make learn prints
