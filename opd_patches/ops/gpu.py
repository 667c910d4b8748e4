"""GPU preflight: refuse to start while another process holds memory on the GPUs this run may use.

Concurrent jobs on one GPU fail during vLLM's memory transitions (sleep/wake between rollout and
update), so a run checks before Ray starts. The assigned GPUs are the ones CUDA_VISIBLE_DEVICES
names (indices or `GPU-<uuid>` prefixes), all of them when it is unset: Ray may place the run on any
visible GPU. The data come from `nvidia-smi --query-compute-apps`; with no nvidia-smi (or no driver)
the query answers None ("no GPU") and the check is skipped.

`check(query=...)` takes the query as a function so the decision logic is tested with canned
nvidia-smi output on machines without a GPU.
"""

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

APPS_QUERY = ["--query-compute-apps=gpu_uuid,pid,process_name,used_memory", "--format=csv,noheader,nounits"]
GPUS_QUERY = ["--query-gpu=index,uuid", "--format=csv,noheader"]


class GpuBusy(RuntimeError):
    """Another process holds memory on an assigned GPU; the message names pid, process and MiB."""


@dataclass(frozen=True)
class GpuProcess:
    index: str  # nvidia-smi's index (PCI bus order)
    uuid: str
    pid: int
    name: str
    used_mib: int | None  # None where the driver reports [N/A] (e.g. some MIG or container setups)

    def describe(self) -> str:
        mem = "an unknown amount of memory" if self.used_mib is None else f"{self.used_mib} MiB"
        return f"GPU {self.index} ({self.uuid}): pid {self.pid} ({self.name}) holds {mem}"


def parse_gpus(text: str) -> list[dict]:
    """`nvidia-smi --query-gpu=index,uuid --format=csv,noheader` -> [{"index": "0", "uuid": "GPU-..."}]."""
    gpus = []
    for line in text.splitlines():
        if line.strip():
            index, uuid = (part.strip() for part in line.split(",", 1))
            gpus.append({"index": index, "uuid": uuid})
    return gpus


def _mib(value: str) -> int | None:
    try:
        return int(float(value))
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_apps(text: str) -> list[dict]:
    """`nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits`
    -> [{"uuid", "pid", "name", "used_mib"}]. A process name may itself contain commas."""
    apps = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("No running"):
            continue
        uuid, pid, rest = (part.strip() for part in line.split(",", 2))
        name, mem = (part.strip() for part in rest.rsplit(",", 1))
        apps.append({"uuid": uuid, "pid": int(pid), "name": name, "used_mib": _mib(mem)})
    return apps


def nvidia_smi_query(timeout: float = 30.0):
    """(gpus, apps) from nvidia-smi, or None when this machine has no usable NVIDIA GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        gpus = subprocess.run([exe, *GPUS_QUERY], capture_output=True, text=True, timeout=timeout)
        apps = subprocess.run([exe, *APPS_QUERY], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"[opd] GPU preflight skipped: nvidia-smi did not answer ({exc}).", file=sys.stderr, flush=True)
        return None
    if gpus.returncode != 0 or apps.returncode != 0:
        err = (gpus.stderr or apps.stderr or gpus.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"[opd] GPU preflight skipped: nvidia-smi failed ({err[0]}).", file=sys.stderr, flush=True)
        return None
    return parse_gpus(gpus.stdout), parse_apps(apps.stdout)


def assigned(gpus: list[dict], selection=None) -> list[dict]:
    """The GPUs a run may use. selection: None -> CUDA_VISIBLE_DEVICES (all GPUs when unset); else a
    list of indices or UUID prefixes. Entries that match no GPU (e.g. MIG devices) are reported and skipped."""
    if selection is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return list(gpus)
        selection = [v.strip() for v in visible.split(",") if v.strip()]
    chosen = []
    for entry in map(str, selection):
        if entry.startswith("-"):  # CUDA stops at the first invalid entry; "-1" hides every GPU
            break
        match = [g for g in gpus if g["index"] == entry or g["uuid"].startswith(entry)]
        if not match:
            print(f"[opd] GPU preflight: cannot match {entry!r} to a GPU nvidia-smi lists; not checked.",
                  file=sys.stderr, flush=True)
        chosen += [g for g in match if g not in chosen]
    return chosen


def _ancestors(pid: int) -> set[int]:
    """pid and its parents (Linux /proc): a study that launched this run may itself hold a GPU."""
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return seen


def busy(selection=None, query=nvidia_smi_query, own_pids=None) -> list[GpuProcess] | None:
    """Processes other than this one (and its ancestors) holding memory on the assigned GPUs; None: no GPU."""
    answer = query()
    if answer is None:
        return None
    gpus, apps = answer
    chosen = {g["uuid"]: g["index"] for g in assigned(gpus, selection)}
    own = _ancestors(os.getpid()) if own_pids is None else set(own_pids)
    return [
        GpuProcess(chosen[a["uuid"]], a["uuid"], a["pid"], a["name"], a["used_mib"])
        for a in apps
        if a["uuid"] in chosen and a["pid"] not in own
    ]


def check(selection=None, query=nvidia_smi_query, wait_s: float = 30.0, poll_s: float = 2.0, own_pids=None) -> str:
    """Raise GpuBusy naming each process on an assigned GPU; return a one-line verdict otherwise.

    Waits up to wait_s for the GPUs to clear first: the Ray workers of a run that just ended (e.g. the
    previous training of a study or of `make smoke`) take a few seconds to release their memory.
    """
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        found = busy(selection, query, own_pids)
        if found is None:
            return "no NVIDIA GPU found (nvidia-smi absent or failing): GPU preflight skipped"
        if not found:
            return "assigned GPUs are free" + (" (after waiting)" if waiting else "")
        if time.monotonic() >= deadline:
            break
        if not waiting:
            print(f"[opd] GPU preflight: {found[0].describe()}; waiting up to {wait_s:.0f} s for it to end.",
                  file=sys.stderr, flush=True)
            waiting = True
        time.sleep(poll_s)
    lines = "\n  ".join(p.describe() for p in found)
    raise GpuBusy(
        f"another process holds memory on the GPU(s) assigned to this run:\n  {lines}\n"
        "Concurrent jobs on one GPU fail during vLLM's memory transitions. Wait for them to end, choose free "
        "GPUs with CUDA_VISIBLE_DEVICES, or force with opd.force=true / FORCE=1."
    )
