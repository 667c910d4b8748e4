"""One training run per machine: a lock file held with `fcntl.flock` for the run's lifetime, plus the
GPU preflight (opd_patches/ops/gpu.py).

    with lock.acquire(force=False, gpus=None, run="outputs/k1"):
        ...   # child processes pass through (OPD_LOCK_HELD), e.g. the trainings of a study

    python -m opd_patches.ops.lock      # who holds it: exit 0 when free, 75 when held

Conventions:
- The lock file is `${OPD_LOCK_DIR:-$HOME/.cache/opd}/run.lock`. The kernel drops an flock when its
  holder dies (even by kill -9), so a crashed run never leaves the lock taken; the file's content
  (JSON: token, pid, host, start time, command, run folder) only names the holder for the message.
  The file is emptied on release but never deleted (deleting a lock file lets two processes hold
  different inodes).
- A holder exports `OPD_LOCK_HELD=<token>`; a process started with a token that matches the live
  holder's passes without re-acquiring. A stale token (its holder gone) is ignored.
- force=True (`opd.force=true`, `FORCE=1` in run.sh) skips both checks: the lock is taken if free,
  otherwise the run goes ahead without it; its token starts with `forced:` and children inherit the
  choice (they skip both checks too).
- Refusals raise `LockBusy` or `gpu.GpuBusy` (both in `BUSY`); opd_patches.main turns them into exit
  status 75 (`EXIT_BUSY`, sysexits EX_TEMPFAIL), before Ray starts.
- One lock per lock folder: two deliberate runs on disjoint GPUs of one host each need their own
  OPD_LOCK_DIR (the GPU preflight still guards the GPUs); on a cluster whose home folder is shared
  between hosts, point OPD_LOCK_DIR at a node-local folder.
"""

import datetime
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path

from opd_patches.ops import gpu

ENV_TOKEN = "OPD_LOCK_HELD"
LOCK_NAME = "run.lock"
EXIT_BUSY = 75  # sysexits EX_TEMPFAIL: try again later (3 is the non-finite guard's, ops/run_summary.py)
FORCE_HINT = "force with opd.force=true / FORCE=1"


class LockBusy(RuntimeError):
    """Another run of this project holds the lock; the message names it."""


BUSY = (LockBusy, gpu.GpuBusy)


def lock_dir() -> Path:
    return Path(os.environ.get("OPD_LOCK_DIR") or Path.home() / ".cache" / "opd").expanduser()


def lock_path() -> Path:
    return lock_dir() / LOCK_NAME


def _open(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children (PEP 446)
    except OSError as exc:
        raise OSError(f"cannot open the run lock {path} ({exc}): set OPD_LOCK_DIR to a writable folder.") from exc


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def holder(path: Path | None = None) -> dict:
    """The content the current holder wrote ({} when empty or unreadable)."""
    path = path or lock_path()
    for _ in range(5):  # the holder writes right after taking the lock: retry a torn read briefly
        try:
            return json.loads(path.read_text() or "{}")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            time.sleep(0.1)
    return {}


def is_held(path: Path | None = None) -> bool:
    """Whether a live process holds the lock (probes it; never keeps it)."""
    fd = _open(path or lock_path())
    try:
        if _try_flock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        return True
    finally:
        os.close(fd)


def describe(info: dict) -> str:
    if not info:
        return "an unidentified process (its lock file is empty)"
    where = f"pid {info.get('pid', '?')} on {info.get('host', '?')}"
    text = f"run {info.get('run') or '?'} ({where}, started {info.get('started', '?')}, command: {info.get('command', '?')})"
    if info.get("host") not in (None, socket.gethostname()):
        text += " [held from another host: the lock folder is shared; set OPD_LOCK_DIR to a node-local folder]"
    return text


class RunLock:
    """A held (or inherited, or forced) run lock; release() is idempotent and also runs on context exit."""

    def __init__(self, path: Path, token: str, fd: int | None = None, inherited: bool = False):
        self.path, self.token, self._fd, self.inherited = path, token, fd, inherited

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if not self.inherited and os.environ.get(ENV_TOKEN) == self.token:
            del os.environ[ENV_TOKEN]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _inherited(path: Path) -> RunLock | None:
    token = os.environ.get(ENV_TOKEN)
    if not token:
        return None
    if token.startswith("forced:") or (holder(path).get("token") == token and is_held(path)):
        return RunLock(path, token, inherited=True)
    print(f"[opd] ignoring {ENV_TOKEN}={token}: its holder no longer holds {path}.", file=sys.stderr, flush=True)
    return None


def _take(path: Path, force: bool, run, command) -> RunLock:
    # A forced token says so, and children inherit the choice (they skip the GPU preflight too).
    token = ("forced:" if force else "") + f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    fd = _open(path)
    if not _try_flock(fd):
        os.close(fd)
        if not force:
            raise LockBusy(f"another run holds the lock {path}: {describe(holder(path))}. Wait for it to finish, or {FORCE_HINT}.")
        print(f"[opd] forced: running although {describe(holder(path))} holds {path}.", file=sys.stderr, flush=True)
        os.environ[ENV_TOKEN] = token
        return RunLock(path, token)
    info = {
        "token": token,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": (command or " ".join(sys.argv))[:1000],
        "run": None if run is None else str(run),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    os.environ[ENV_TOKEN] = token
    return RunLock(path, token, fd=fd)


def acquire(force: bool = False, gpus=None, run=None, command=None, gpu_query=gpu.nvidia_smi_query,
            gpu_wait_s: float = 30.0) -> RunLock:
    """Take the run lock, then check the GPUs; raise LockBusy / gpu.GpuBusy (see the module docstring).

    gpus: None -> the GPUs CUDA_VISIBLE_DEVICES names (all when unset; nothing on a host without
    nvidia-smi); [] -> no GPU check (the CPU platform); a list of indices or UUIDs -> those.
    """
    path = lock_path()
    held = _inherited(path) or _take(path, force, run, command)
    if force or held.token.startswith("forced:"):
        print("[opd] forced (opd.force=true / FORCE=1): GPU preflight skipped.", file=sys.stderr, flush=True)
        return held
    if gpus is not None and len(gpus) == 0:
        return held
    try:
        verdict = gpu.check(gpus, query=gpu_query, wait_s=gpu_wait_s)
    except gpu.GpuBusy:
        held.release()
        raise
    print(f"[opd] GPU preflight: {verdict}.", flush=True)
    return held


def main(argv=None) -> int:
    path = lock_path()
    if is_held(path):
        print(f"{path}: held by {describe(holder(path))}")
        return EXIT_BUSY
    print(f"{path}: free")
    return 0


if __name__ == "__main__":
    sys.exit(main())
