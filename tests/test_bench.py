"""`make bench` machinery at SIZE=cpu: a phase runs, writes valid JSON, and merges without touching others."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from flag_runs import BENCH_RECIPES
from tools.bench import results
from tools.bench.run import PHASES

REPO = Path(__file__).resolve().parents[1]


def test_merge_keeps_other_phases_and_is_atomic(tmp_path):
    out = tmp_path / "bench.json"
    results.merge(out, "step", {"size": "full", "rows": []})
    results.merge(out, "kernels", {"size": "cpu", "rows": [{"name": "x"}]})
    results.merge(out, "kernels", {"size": "cpu", "rows": [{"name": "y"}]})
    doc = json.loads(out.read_text())
    assert set(doc["phases"]) == {"step", "kernels"} and doc["phases"]["kernels"]["rows"] == [{"name": "y"}]
    assert "machine" in doc["phases"]["step"] and not list(tmp_path.glob("*.tmp"))


def test_phase_registry_names_the_three_phases_or_explains():
    assert {"kernels", "teacher"} <= set(PHASES)
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "--phase", "nope", "--size", "cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "PHASES" in proc.stderr


def test_kernels_phase_at_cpu_size_writes_valid_json(tmp_path, capsys):
    """`python -m tools.bench` is `run.main` (its command line: the phase-registry test above)."""
    from tools.bench import run

    out = tmp_path / "bench.json"
    results.merge(out, "teacher", {"size": "cpu", "rows": []})
    assert run.main(["--phase", "kernels", "--size", "cpu", "--out", str(out), "--no-model", "--variants", "k1_pg",
                     "topk_default", "lean_topk_tail"]) == 0
    stdout = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert set(doc["phases"]) == {"teacher", "kernels"}
    rows = doc["phases"]["kernels"]["rows"]
    assert [r["name"] for r in rows] == ["loss/k1_pg", "loss/topk_default", "loss/lean_topk_tail"]
    for r in rows:
        assert r["time_s"] > 0 and r["ref_time_s"] > 0 and r["ratio"] > 0 and r["peak_gib"] is None
    assert "loss/lean_topk_tail" in stdout and "ratio" in stdout


@pytest.mark.fresh_process
def test_save_phase_at_cpu_size_restores_and_builds_the_export(tmp_path):
    """`make bench PHASE=save SIZE=cpu`: upstream's save against the background one (restored exactly by
    upstream's load) and the HF export inside the save against the one the finish builds (same tensors)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "--phase", "save", "--size", "cpu", "--out",
                           str(out), "--workdir", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["phases"]["save"]["rows"]}
    assert list(rows) == ["save/upstream", "save/background", "save/background_with_hf_export",
                          "export/built_by_finish"]
    assert rows["save/background"]["restored_exact"] is True
    assert rows["export/built_by_finish"]["equal_to_upstream"] is True
    assert rows["export/built_by_finish"]["export_gb"] > 0
    assert not any((tmp_path / "work").glob("bench_save_*"))  # every state deleted after its row


@pytest.mark.fresh_process
def test_lastsave_phase_at_cpu_size_times_the_whole_last_save(tmp_path):
    """`make bench PHASE=lastsave SIZE=cpu`: upstream's save and the finish (export built, validated, hashed,
    receipt), a first round then the later ones, each export validated again idle."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "--phase", "lastsave", "--size", "cpu", "--out",
                           str(out), "--workdir", str(tmp_path / "work"), "--rounds", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    entry = json.loads(out.read_text())["phases"]["lastsave"]
    rows = {r["name"]: r for r in entry["rows"]}
    assert list(rows) == ["lastsave/first", "lastsave/with_finish#1", "lastsave/with_finish#2"]
    for r in rows.values():
        assert r["validation_ok"] is r["idle_validation_ok"] is True
        assert r["time_s"] >= r["upstream_call_s"] + r["export_s"] > 0
        assert {"files", "load", "finite", "generate"} <= set(r["validation_s"])
    assert rows["lastsave/first"]["ratio"] is None and rows["lastsave/with_finish#1"]["ratio"] == 1.0
    assert entry["state_gb"] > 0 and entry["disk_write_gbps"] > 0
    assert not (tmp_path / "work" / "bench_lastsave").exists()  # every state deleted


def test_cpu_kernels_script_writes_json(tmp_path, capsys):
    from tools.bench import cpu_kernels

    out = tmp_path / "cpu.json"
    assert cpu_kernels.main(["--out", str(out), "--tokens", "64", "--vocab", "512", "--repeats", "1", "--variants",
                             "topk_tail", "lean_topk_tail"]) == 0
    assert f"[bench] wrote {out}" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["config"]["vocab"] == 512 and len(doc["rows"]) == 2 and doc["rows"][1]["ratio"] > 0


def test_layout_phase_packed_and_padded_compute_the_batched_function():
    """The `layout` rows time the same function: VERL's packed (rmpad) row and its padded layout give the
    batched row's hidden states on the kept tokens (a packed row without the block mask would not)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from tools.bench.layout import run_phase
    from tools.bench.sizes import SIZES

    entry = run_phase(replace(SIZES["cpu"], repeats=1), SimpleNamespace())  # the values, not the timings
    rows = {r["name"]: r for r in entry["rows"]}
    att = rows.pop("attention/varlen")  # torch_varlen vs batched causal sdpa (CPU: its per-sequence fallback)
    assert att["path"] == "per-sequence sdpa" and att["time_s"] > 0
    assert max(att[f"{x}_max_abs_diff"] for x in ("out", "grad_q", "grad_k", "grad_v")) < 1e-4
    assert set(rows) == {"layout/batched", "layout/packed", "layout/padded", "layout/packed_varlen"}
    for r in rows.values():
        assert r["time_s"] > 0 and r["hidden_max_abs_diff"] < 1e-4


@pytest.mark.slow
def test_step_phase_runs_two_recipes_at_once_and_reads_verl_timings(bench_step_run):
    """`make bench PHASE=step RECIPE="k1 topk_tail" GPUS="0 1"` at SIZE=cpu (tests/conftest.py): two real run.sh
    trainings at the same time (own lock folders and model folders), two steps each with the smoke overlay's
    lengths, one save after step 1; the rows come from VERL's own metrics.jsonl (timing_s/*), and every step
    is accounted for by its phases within the CPU's slack."""
    proc, tmp_path = bench_step_run, bench_step_run.out
    out = tmp_path / "bench.json"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    entry = json.loads(out.read_text())["phases"]["step"]
    assert set(entry["recipes"]) == {"k1", "topk", "topk_tail"}  # the earlier recipe's result is kept
    max_response = OmegaConf.load(REPO / "recipes" / "overlay" / "smoke.yaml").data.max_response_length
    for name, gpu in zip(BENCH_RECIPES, ("0", "1"), strict=True):
        r = entry["recipes"][name]
        assert r["returncode"] == 0 and r["steps_done"] == 2 and r["gpu"] == gpu, r
        run = tmp_path / "work" / name / f"run_{name}"
        assert (run / "global_step_1").is_dir() and not (run / "global_step_2").exists()  # --save-after 1
        assert all(s["response_length/max"] <= max_response for s in r["steps"]), r["steps"]
    rows = {r["name"]: r for r in entry["rows"]}
    assert set(rows) == {f"step/{name}/hf/{step}" for name in BENCH_RECIPES for step in (1, 2)}
    for r in rows.values():
        assert r["timing_s/gen"] > 0 and r["timing_s/update_actor"] > 0 and r["ref_time_s"] <= r["time_s"] * 1.01


def test_specdecode_rows_pair_each_speculative_run_with_the_plain_one():
    """tools/bench/spec_decode.py (GPU): a speculative row's ratio is its time over the plain row's at the same
    batch and temperature; plain rows have none."""
    from tools.bench.spec_decode import pair_rows

    def row(engine, batch, temperature, seconds, drafts=0.0, accepted=0.0):
        return {"engine": engine, "batch": batch, "temperature": temperature, "tokens": 1024, "seconds": seconds,
                "drafts": drafts, "accepted": accepted}

    rows = pair_rows([row("plain", 32, 1.0, 4.0), row("plain", 8, 0.1, 3.0),
                      row("spec", 32, 1.0, 5.0), row("spec", 8, 0.1, 1.5, drafts=100, accepted=250)], "rollout")
    by = {r["name"]: r for r in rows}
    assert by["specdecode/rollout/spec/b32/T1"]["ratio"] == 1.25
    assert by["specdecode/rollout/spec/b8/T0.1"]["ratio"] == 0.5 and by["specdecode/rollout/spec/b8/T0.1"]["ref_time_s"] == 3.0
    assert by["specdecode/rollout/plain/b8/T0.1"]["ratio"] is None
    assert by["specdecode/rollout/plain/b32/T1"]["tok_per_s"] == 32 * 1024 / 4.0


def test_step_rows_carry_a_speculating_rollouts_acceptance(tmp_path):
    """tools/bench/step.py (GPU with a speculative_config): each step's row keeps the trainer's rollout/spec_*
    figures beside its timings; a step without them (no speculation) has none."""
    from tools.bench.step import step_rows

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(e) for e in [
        {"step": 1, "data": {"timing_s/step": 30.0, "timing_s/gen": 20.0, "rollout/spec_drafted_tokens": 400.0,
                             "rollout/spec_accepted_tokens": 100.0, "rollout/spec_engine_accept_rate": 0.25}},
        {"step": 2, "data": {"timing_s/step": 31.0, "timing_s/gen": 21.0}},
        {"step": 2, "data": {"val-core/x": 0.5}},  # no timings: not a step row
    ]))
    rows = step_rows(metrics)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["rollout/spec_drafted_tokens"] == 400.0 and rows[0]["rollout/spec_engine_accept_rate"] == 0.25
    assert rows[0]["timing_s/gen"] == 20.0 and not any(k.startswith("rollout/spec_") for k in rows[1])
