"""A killed study leaves nothing running (opd_patches/study/guard.py), on real process trees.

The launched command stands in for run.sh -> Ray: it leaves an orphan behind (re-parented to init,
as Ray's dashboard and runtime-env agents are when their raylet dies) and a process in a group of
its own. The study stand-in is a Python process calling runner.run_child, SIGKILLed mid-run.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

import pytest

from opd_patches.study import runner

# an orphan (its parent subshell exits at once), a process in its own group, then the foreground sleep
TREE = ("(sleep 300 &) ; "
        f"{sys.executable} -c 'import os, time; os.setpgid(0, 0); time.sleep(300)' & "
        "sleep 300")


def _alive(pids):
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids, timeout):
    """Those of `pids` still alive (zombies aside) after waiting up to `timeout` s for them to end."""
    deadline = time.monotonic() + timeout
    while (left := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.fresh_process
def test_sigkilled_study_takes_its_run_down(tmp_path):
    child_file = tmp_path / "child.json"
    study = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from pathlib import Path
        from opd_patches.study import runner
        runner.run_child(["sh", "-c", {TREE!r}], None, Path({str(tmp_path / 'run.log')!r}), Path({str(child_file)!r}))
        """)], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the guard, sh, the orphan, the own-group process, the sleep
            if child_file.exists() and len(runner.session_pids(json.loads(child_file.read_text())["sid"])) >= 5:
                break
            time.sleep(0.2)
        sid = json.loads(child_file.read_text())["sid"]
        tree = runner.session_pids(sid)
        assert len(tree) >= 5, tree
        orphans = [p for p in tree if p != sid and psutil.Process(p).ppid() not in tree]  # re-parented to init
        assert orphans, "no orphan in the tree: the test would prove less"
        study.kill()  # SIGKILL: no clean-up of its own
        study.wait(timeout=10)
        assert wait_gone(tree, 30) == [], [psutil.Process(p).cmdline() for p in _alive(tree)]
    finally:
        study.kill()
        for pid in _alive(runner.session_pids(json.loads(child_file.read_text())["sid"]) if child_file.exists() else []):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.fresh_process
def test_a_normal_exit_sweeps_the_session_and_keeps_the_status(tmp_path):
    child_file = tmp_path / "child.json"
    code = runner.run_child(["sh", "-c", "(sleep 300 &) ; exit 3"], None, tmp_path / "run.log", child_file)
    assert code == 3
    assert runner.session_pids(json.loads(child_file.read_text())["sid"]) == []


def test_guard_refuses_a_parent_that_is_already_gone(tmp_path):
    # STUDY_PID is not the guard's parent: as if the study died before the guard armed its signal
    out = subprocess.run([sys.executable, "-m", "opd_patches.study.guard", "1", "--", "touch", str(tmp_path / "ran")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 130 and not (tmp_path / "ran").exists(), out.stderr


def test_a_session_leader_alone_sees_no_other_process():
    """The guard sweeps its own session after every command until session_pids() is empty: the `ps` it
    runs for that is in the session too and must not count (it did: every guarded training and
    evaluation of a study waited the sweep's full 20 s)."""
    code = "import os; from opd_patches.study.guard import session_pids; print(session_pids(os.getsid(0)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, start_new_session=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])
