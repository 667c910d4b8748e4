"""`python -m opd_patches.study.guard STUDY_PID -- CMD...`: run CMD (a training's run.sh or an
evaluation) and take its whole process tree down with it when the study process dies, SIGKILL included.

The study starts the guard as the leader of a new session; CMD runs in a process group of its own
inside that session, so everything it starts (Ray's gcs_server, raylet, workers, dashboard and
runtime-env agents) stays in the session. A killed trainer is not enough: Ray's agents outlive their
driver and raylet, re-parented to init (seen with ray 2.60). Hence:
- the kernel sends the guard SIGTERM when the study dies (prctl PR_SET_PDEATHSIG, set by the guard
  itself; a study already gone by then is caught by comparing the parent pid);
- on SIGTERM/SIGINT/SIGHUP the guard sends CMD's group SIGTERM, SIGKILL after GRACE_S, then SIGKILLs
  every process left in its session until none is;
- when CMD exits by itself the guard sweeps the session the same way and exits with CMD's status.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
GRACE_S = 10.0  # SIGTERM -> SIGKILL of CMD's group (shorter than the study's own wait for the guard, runner.stop_session)
SWEEP_S = 20.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` other than this one and the `ps` asking (from ps; zombies excluded).

    Called by the guard about its own session, `ps` is in it: counted, the sweep after every command
    waited its whole SWEEP_S for a process that is gone when it is killed."""
    ps = subprocess.Popen(["ps", "-eo", "pid=,sid=,stat="], stdout=subprocess.PIPE, text=True)
    out, _ = ps.communicate()
    pids = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and int(parts[1]) == sid and not parts[2].startswith("Z") and int(parts[0]) not in (os.getpid(), ps.pid):
            pids.append(int(parts[0]))
    return pids


def kill_session(sid: int, timeout: float = SWEEP_S) -> list[int]:
    """SIGKILL every process of session `sid` (but this one) until none is left; returns what still lives."""
    deadline = time.monotonic() + timeout
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return session_pids(sid)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent (thread) exits (Linux only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    for sig in STOP_SIGNALS:  # a second signal must not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop(signum)


def stop_group(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM the group of `proc` (its leader), SIGKILL it after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m opd_patches.study.guard STUDY_PID -- CMD...", file=sys.stderr)
        return 2
    study, cmd = int(argv[0]), argv[2:]
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_stop)
    die_with_parent(signal.SIGTERM)
    if os.getppid() != study:  # the study died before the line above took effect
        return 130
    sid = os.getsid(0)
    proc = None
    try:
        proc = subprocess.Popen(cmd, process_group=0)
        code = proc.wait()
    except _Stop as exc:
        if proc is not None:
            stop_group(proc)
        code = 128 + exc.args[0]
    for sig in STOP_SIGNALS:  # the sweep runs to its end whatever arrives now
        signal.signal(sig, signal.SIG_IGN)
    kill_session(sid)  # what CMD's tree left behind (Ray's agents), also after a normal exit
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
