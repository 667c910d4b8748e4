"""Receipts, listing and pruning (opd_patches/ops/receipts.py, checkpoints.py) on synthetic run folders.

The folders mimic upstream's layout (global_step_N/actor/..., data.pt, actor/huggingface/); the
code under test only reads and writes files, so no trainer is needed here (tests/test_ops_e2e.py
runs the real one).
"""

import errno
import hashlib
import json
import os
import subprocess
import sys

import pytest

from opd_patches.ops import checkpoints, receipts
from opd_patches.ops import run_summary as summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_state(run, step, complete=True, validated=True):
    d = run / f"global_step_{step}"
    (d / "actor" / "huggingface").mkdir(parents=True)
    (d / "actor" / f"model_world_size_1_rank_0.pt").write_bytes(os.urandom(64) + bytes([step]))
    (d / "actor" / "huggingface" / "model.safetensors").write_bytes(b"w" * (10 + step))
    (d / "data.pt").write_bytes(b"d" * step)
    if complete:
        receipts.write(d, step, {"ok": validated, "checks": {}, "error": None if validated else "bad"})
    return d


def steps(run):
    return [s["step"] for s in checkpoints.list_states(run)]


def test_receipt_schema_and_hashes(tmp_path):
    d = make_state(tmp_path, 3)
    r = json.loads((d / "receipt.json").read_text())
    assert r["step"] == 3 and r["complete"] is True and r["hf_export"] == "actor/huggingface"
    assert set(r["files"]) == {"actor/model_world_size_1_rank_0.pt", "actor/huggingface/model.safetensors", "data.pt"}
    assert r["files"]["data.pt"] == {"bytes": 3, "sha256_blocks": _blocks_sha256(b"ddd", receipts.BLOCK)}
    assert r["validation"]["ok"] is True and r["written_at"].endswith("+00:00")
    assert receipts.verify(d) == []
    (d / "data.pt").write_bytes(b"x" * 3)  # same size, other content: only a full verify sees it
    assert receipts.verify(d) == ["data.pt"]


def _blocks_sha256(data: bytes, block: int) -> str:
    """The receipt's digest written out: sha256 over the sha256 digests of consecutive blocks."""
    return hashlib.sha256(b"".join(hashlib.sha256(data[i:i + block]).digest()
                                   for i in range(0, len(data), block))).hexdigest()


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_block_digest_equals_the_written_out_reference(tmp_path, monkeypatch, size):
    """Files of no, one partial, exactly one and several blocks (4 KiB here), hashed by a pool of 3 threads."""
    monkeypatch.setattr(receipts, "BLOCK", 4096)
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "g").write_bytes(data[::-1])
    assert receipts.hash_files(tmp_path, ["f", "g"], workers=3) == {
        "f": {"bytes": size, "sha256_blocks": _blocks_sha256(data, 4096)},
        "g": {"bytes": size, "sha256_blocks": _blocks_sha256(data[::-1], 4096)}}


def test_the_digest_command_prints_what_the_receipt_holds(tmp_path):
    """`python -m opd_patches.ops.receipts FILE` (the by-hand check docs/training.md names)."""
    d = make_state(tmp_path, 1)
    f = d / "actor" / "model_world_size_1_rank_0.pt"
    out = subprocess.run([sys.executable, "-m", "opd_patches.ops.receipts", str(f)], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    held = json.loads((d / "receipt.json").read_text())["files"]["actor/model_world_size_1_rank_0.pt"]["sha256_blocks"]
    assert out.returncode == 0 and out.stdout.split() == [held, str(f)]


def test_a_receipt_with_plain_sha256_still_verifies(tmp_path):
    """Receipts written before `sha256_blocks` list one plain sha256 per file; resume and VERIFY=1 check them."""
    d = make_state(tmp_path, 2)
    r = json.loads((d / "receipt.json").read_text())
    for rel, meta in r["files"].items():
        r["files"][rel] = {"bytes": meta["bytes"], "sha256": hashlib.sha256((d / rel).read_bytes()).hexdigest()}
    (d / "receipt.json").write_text(json.dumps(r))
    assert receipts.verify(d) == []
    (d / "data.pt").write_bytes(b"x" * 2)
    assert receipts.verify(d) == ["data.pt"]


@pytest.mark.parametrize("damage", ["missing", "corrupt", "truncated_file", "wrong_step", "not_complete"])
def test_damaged_or_missing_receipt_is_incomplete(tmp_path, damage):
    make_state(tmp_path, 1)
    d = make_state(tmp_path, 2)
    if damage == "missing":
        (d / "receipt.json").unlink()
    elif damage == "corrupt":
        (d / "receipt.json").write_text('{"step": 2, "complete": tr')
    elif damage == "truncated_file":
        (d / "actor" / "huggingface" / "model.safetensors").write_bytes(b"w")
    elif damage == "wrong_step":
        r = json.loads((d / "receipt.json").read_text())
        (d / "receipt.json").write_text(json.dumps({**r, "step": 7}))
    else:
        r = json.loads((d / "receipt.json").read_text())
        (d / "receipt.json").write_text(json.dumps({**r, "complete": False}))
    states = checkpoints.list_states(tmp_path)
    assert [(s["step"], s["complete"]) for s in states] == [(1, True), (2, False)]
    assert states[1]["reason"] and states[1]["validated"] is None
    assert checkpoints.newest_complete(tmp_path) == tmp_path / "global_step_1"
    if damage != "corrupt":  # the listing command once (a subprocess imports VERL: seconds)
        return
    out = subprocess.run([sys.executable, "-m", "opd_patches.ops.checkpoints", "list", str(tmp_path)],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0
    row = [line for line in out.stdout.splitlines() if line.split()[:1] == ["2"]][0]
    assert "NO" in row and states[1]["reason"] in row


def test_full_disk_while_writing_a_receipt_leaves_the_old_one(tmp_path, monkeypatch):
    d = make_state(tmp_path, 4)
    before = (d / "receipt.json").read_text()
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as exc:
        receipts.write(d, 4, {"ok": True, "checks": {}, "error": None})
    assert exc.value.errno == errno.ENOSPC
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert (d / "receipt.json").read_text() == before  # the old receipt, whole
    assert sorted(p.name for p in d.iterdir()) == ["actor", "data.pt", "receipt.json"]  # no temp file left
    # A state whose first receipt could not be written stays incomplete; the earlier ones stay complete.
    e = make_state(tmp_path, 5, complete=False)
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        receipts.write(e, 5, None)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert [(s["step"], s["complete"]) for s in checkpoints.list_states(tmp_path)] == [(4, True), (5, False)]


def test_prune_keeps_newest_complete_across_processes(tmp_path):
    for step in (2, 4, 6):  # "an earlier process" left three complete states
        make_state(tmp_path, step)
    assert checkpoints.prune(tmp_path, keep=2) == [2]
    for step in (8, 10):  # "this process" adds two more
        make_state(tmp_path, step)
        checkpoints.prune(tmp_path, keep=2)
    assert steps(tmp_path) == [8, 10]


def test_prune_rules_for_incomplete_folders(tmp_path):
    for step in (1, 2, 3):
        make_state(tmp_path, step)
    make_state(tmp_path, 4, complete=False)  # a save in progress (or never finished)
    assert checkpoints.prune(tmp_path, keep=1) == [1, 2]
    assert steps(tmp_path) == [3, 4]  # newest complete kept, the incomplete successor untouched
    make_state(tmp_path, 0, complete=False)  # crash debris older than the newest complete state
    assert checkpoints.prune(tmp_path, keep=1) == [0]
    # Nothing complete: nothing is removed.
    other = tmp_path / "other"
    make_state(other, 1, complete=False)
    assert checkpoints.prune(other, keep=1) == [] and steps(other) == [1]
    # keep <= 0 still keeps the newest complete state.
    assert checkpoints.plan_prune(checkpoints.list_states(tmp_path), 0) == []


def test_discard_after_and_validation_status(tmp_path):
    make_state(tmp_path, 1, validated=False)
    make_state(tmp_path, 2)
    make_state(tmp_path, 3, complete=False)
    assert [s["validated"] for s in checkpoints.list_states(tmp_path)] == [False, True, None]
    assert checkpoints.discard_after(tmp_path, 2) == [3]
    assert steps(tmp_path) == [1, 2]


def test_run_summary_names_the_newest_complete_state(tmp_path):
    make_state(tmp_path, 5)
    make_state(tmp_path, 6, complete=False)
    s = summary.write(tmp_path, "wall_clock", 6, "clock", requested_steps=10)
    assert summary.read(tmp_path) == s
    assert (s["status"], s["steps_done"], s["last_complete_step"]) == ("wall_clock", 6, 5)
    assert "wall_clock after step 6" in summary.line(s)


def flip_one_byte(path):
    """One byte changed in the middle of the file; the size stays the same."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_byte_in_newest_state_is_never_resumed_from(tmp_path, capsys):
    for step in (1, 2, 3):
        make_state(tmp_path, step)
    shard = "actor/model_world_size_1_rank_0.pt"
    flip_one_byte(tmp_path / "global_step_3" / shard)
    assert checkpoints.list_states(tmp_path)[-1]["complete"] is True  # sizes match: a plain listing cannot see it
    verified = checkpoints.list_states(tmp_path, verify=True)
    assert [(s["step"], s["complete"]) for s in verified] == [(1, True), (2, True), (3, False)]
    assert verified[-1]["reason"] == f"sha256 differs from receipt: {shard}"
    assert checkpoints.main(["list", str(tmp_path), "--verify"]) == 0  # make checkpoints RUN=... VERIFY=1
    row = [line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["3"]][0]
    assert "NO" in row and shard in row
    logged = []
    assert checkpoints.resume_point(tmp_path, log=lambda msg, **_: logged.append(msg)) == tmp_path / "global_step_2"
    assert len(logged) == 1 and "global_step_3" in logged[0] and shard in logged[0]
    # The rejected receipt is set aside: every later listing (and pruning) sees an incomplete folder, naming the file.
    state = checkpoints.list_states(tmp_path)[-1]
    assert state["complete"] is False and shard in state["reason"] and state["reason"].startswith("receipt rejected")
    assert checkpoints.discard_after(tmp_path, 2) == [3]
    # Every complete state damaged: nothing to resume from.
    flip_one_byte(tmp_path / "global_step_1" / "data.pt")
    flip_one_byte(tmp_path / "global_step_2" / "data.pt")
    assert checkpoints.resume_point(tmp_path, log=lambda *a, **k: None) is None


def test_makefile_passes_verify():
    out = subprocess.run(["make", "-n", "checkpoints", "RUN=/x", "VERIFY=1"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "checkpoints list /x --verify" in out.stdout, out.stdout + out.stderr
    out = subprocess.run(["make", "-n", "checkpoints", "RUN=/x"], capture_output=True, text=True, cwd=REPO)
    assert "--verify" not in out.stdout


def test_failed_validation_never_counts_as_kept(tmp_path):
    make_state(tmp_path, 1)
    make_state(tmp_path, 2)
    make_state(tmp_path, 3, validated=False)
    make_state(tmp_path, 4, validated=False)
    # keep=2 counts validated states only (1, 2); the newest complete state (4) stays as the resume point.
    assert checkpoints.prune(tmp_path, keep=2) == [3]
    assert steps(tmp_path) == [1, 2, 4]
    # keep=1: the last validated state (2) is never removed for an unvalidated newer one.
    assert checkpoints.prune(tmp_path, keep=1) == [1]
    assert steps(tmp_path) == [2, 4]
    assert checkpoints.newest_complete(tmp_path).name == "global_step_4"
    assert checkpoints.newest_validated(tmp_path).name == "global_step_2"
    s = summary.write(tmp_path, "finished", 4, "done")
    assert (s["last_complete_step"], s["last_validated_step"]) == (4, 2)
    assert "newest validated state: 2 (resume point: 4)" in summary.line(s)
    # Not validated at all (opd.validate_after_save=false): only the newest complete state is kept.
    other = tmp_path / "other"
    for step in (1, 2):
        d = make_state(other, step, complete=False)
        receipts.write(d, step, None)
    assert checkpoints.prune(other, keep=3) == [1]
