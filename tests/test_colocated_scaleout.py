"""The colocated teacher shards with the actor: 2 FSDP ranks, each scores only its own samples.

One end-to-end run (`EMBEDDED=1 N_GPUS=2 ./run.sh recipe=topk +overlay=smoke`: two logical GPUs on the
CPU platform, gloo collectives, the default colocated placement) with `OPD_TEACHER_DUMP_DIR` set, so that
every rank's `ColocatedTeacherWorker.compute_teacher_logprobs` saves what it received (`input_ids`) and
returned (`teacher_logprobs`, `teacher_ids`) per call. Then, per training step:
- both ranks were called, each with its own, non-empty half of the batch: the two sample sets are
  disjoint and together are the whole batch (train_batch_size x rollout.n samples);
- the 1-rank result, i.e. one process scoring the whole step's batch with `score_sequences` on the same
  teacher, equals what the ranks returned: ids exactly, log-probs within 1e-5 (fp32; the padding and
  the micro-batch grouping differ);
- the log shows the teacher loaded on rank 0 and on rank 1, and Ray given 2 (logical) GPUs.

The teacher is the embedded one with its matrices re-drawn at a larger scale (conftest.sharpened): the
plain embedded teacher is near-uniform, and near ties would make a top-k id comparison toothless.
"""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from background import Spec, shared_run
from conftest import sharpened

REPO = Path(__file__).resolve().parents[1]
N_RANKS = 2
STEPS = 2
LP_TOL = 1e-5


def _scaleout_spec(base):
    """The 2-rank colocated topk run with the teacher dump (a shared run: tests/background.py)."""
    from conftest import build_embedded

    run_dir, dump = base / "run", base / "run" / "teacher_dump"

    def prepare(base):
        sharpened(build_embedded()["teacher"], base / "sharp_teacher", seed=321)
        dump.mkdir(parents=True)

    return Spec(argv=[str(REPO / "run.sh"), "recipe=topk", "+overlay=smoke",
                      f"distillation.teacher_models.teacher_model.model_path={base / 'sharp_teacher'}",  # last: wins over EMBEDDED's
                      "opd.background_export=true"],  # 2 ranks' shards merged into the export (off in cpu.yaml)
                env={"EMBEDDED": "1", "N_GPUS": str(N_RANKS), "OUTPUT_DIR": str(run_dir), "PYTHON": sys.executable,
                     "OPD_TEACHER_DUMP_DIR": str(dump)},
                timeout=700, prepare=prepare)


scaleout_run = shared_run("scaleout_run", _scaleout_spec, cost=1.5)


@pytest.fixture(scope="module")
def scaleout(scaleout_run):
    """(process, run dir, log text, wall seconds) of the 2-rank colocated topk run with the teacher dump."""
    return scaleout_run, scaleout_run.out / "run", scaleout_run.log, scaleout_run.wall_s


@pytest.fixture(scope="module")
def dumps(scaleout):
    """{(step, rank): dump} from the per-rank, per-call files (call N of a rank is step N)."""
    proc, run_dir, log, _ = scaleout
    assert proc.returncode == 0, log[-4000:]
    out = {}
    for f in sorted((run_dir / "teacher_dump").glob("teacher_rank*_call*.pt")):
        rank, call = map(int, re.fullmatch(r"teacher_rank(\d+)_call(\d+)\.pt", f.name).groups())
        d = torch.load(f, weights_only=True)
        assert d["rank"] == rank and d["world_size"] == N_RANKS
        out[(call, rank)] = d
    return out


def config_of(run_dir):
    return json.loads((run_dir / "manifest.json").read_text())["config"]


@pytest.mark.slow
def test_two_ranks_train_with_the_teacher_on_each(scaleout):
    proc, run_dir, log, wall = scaleout
    assert proc.returncode == 0, log[-4000:]
    print(f"2-rank colocated topk run: {wall:.1f} s")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all("timing_s/teacher" in r["data"] for r in rows)
    config = config_of(run_dir)
    assert config["trainer"]["v1"]["trainer_mode"] == "colocated_teacher"
    assert config["trainer"]["n_gpus_per_node"] == N_RANKS
    # Ray was given the 2 logical GPUs (no teacher pool on top), and the teacher loaded on both ranks.
    assert set(re.findall(r"'num_gpus': (\d+)", log)) == {str(N_RANKS)}
    for rank in range(N_RANKS):
        assert re.search(rf"\[colocated teacher\] rank {rank}: loaded .*sharp_teacher \(k=16, torch.float32, "
                         r"offload=True\) on cpu", log), rank
    pids = {m.group(1) for m in re.finditer(r"pid=(\d+)\)\S*\s+\[colocated teacher\] rank \d: loaded", log)}
    assert len(pids) == N_RANKS  # two worker processes, one teacher each


@pytest.mark.slow
def test_the_finish_builds_each_export_from_both_ranks_shards(scaleout):
    """opd.background_export: upstream saved no weights; the finish merged the 2 ranks' shards, validated."""
    proc, run_dir, log, _ = scaleout
    assert proc.returncode == 0, log[-4000:]
    assert config_of(run_dir)["actor_rollout_ref"]["actor"]["checkpoint"]["save_contents"] == ["model", "optimizer", "extra"]
    assert "Saved hf_model" not in log
    for step in range(1, STEPS + 1):
        state = run_dir / f"global_step_{step}"
        assert sorted(p.name for p in (state / "actor").glob("model_world_size_2_rank_*.pt")) == [
            "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
        receipt = json.loads((state / "receipt.json").read_text())
        assert receipt["validation"]["ok"] is True, receipt["validation"]
        assert any(f.startswith("actor/huggingface/") and f.endswith(".safetensors") for f in receipt["files"])
    assert re.search(r"saved step 1: receipt written, export validation ok, .* export \d+\.\d s", log)


@pytest.mark.slow
def test_each_rank_scores_only_its_own_samples(scaleout, dumps):
    _, run_dir, _, _ = scaleout
    config = config_of(run_dir)
    batch = config["data"]["train_batch_size"] * config["actor_rollout_ref"]["rollout"]["n"]
    assert set(dumps) == {(step, rank) for step in range(1, STEPS + 1) for rank in range(N_RANKS)}
    for step in range(1, STEPS + 1):
        per_rank = [{tuple(s.tolist()) for s in dumps[(step, r)]["input_ids"]} for r in range(N_RANKS)]
        counts = [len(dumps[(step, r)]["input_ids"]) for r in range(N_RANKS)]
        assert counts == [batch // N_RANKS] * N_RANKS, counts  # an even split, nothing scored twice on a rank
        assert all(len(s) == c for s, c in zip(per_rank, counts, strict=True))  # distinct samples
        assert not per_rank[0] & per_rank[1], f"step {step}: a sample scored on both ranks"
        assert sum(counts) == batch  # together: the whole batch (the trainer also checks len(output))


@pytest.mark.slow
def test_sharded_scores_equal_the_one_rank_scores(scaleout, dumps):
    """Each step's samples scored in one process (a 1-rank run's call) equal the two ranks' outputs."""
    from transformers import AutoModelForCausalLM

    from opd_patches.teacher.scoring import score_sequences

    _, run_dir, _, _ = scaleout
    config = config_of(run_dir)
    teacher = AutoModelForCausalLM.from_pretrained(
        config["distillation"]["teacher_models"]["teacher_model"]["model_path"], dtype=torch.float32,
        attn_implementation="sdpa").eval()
    max_tokens = config["actor_rollout_ref"]["rollout"]["log_prob_max_token_len_per_gpu"]
    for step in range(1, STEPS + 1):
        parts = [dumps[(step, r)] for r in range(N_RANKS)]
        k = parts[0]["k"]
        assert k == 16 and all(p["k"] == k for p in parts)
        seqs = [s for p in parts for s in p["input_ids"]]
        got_lp = [x for p in parts for x in p["teacher_logprobs"]]
        got_id = [x for p in parts for x in p["teacher_ids"]]
        ref_lp, ref_id = score_sequences(teacher, seqs, k, max_tokens=max_tokens)
        for seq, lp, ids, rlp, rid in zip(seqs, got_lp, got_id, ref_lp, ref_id, strict=True):
            assert ids.dtype == rid.dtype == torch.int32 and lp.dtype == rlp.dtype == torch.float32
            assert ids.shape == rid.shape == (seq.numel(), k)
            assert torch.equal(ids, rid)
            torch.testing.assert_close(lp, rlp, atol=LP_TOL, rtol=LP_TOL)
