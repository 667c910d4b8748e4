"""Upstream's state files written by a thread of the worker, so that training does not wait for the disk.

VERL's `FSDPCheckpointManager.save_checkpoint` (verl/utils/checkpoint/fsdp_checkpoint_manager.py) writes
each rank's model, optimizer and extra state with `torch.save(obj, path)`: at 1.5B that is 21.3 GB
from GPU memory, tens of seconds during which the trainer waits (docs/performance.md). With `opd.background_state_write`
(in a run's workers; the run-time patch opd_patches/patches/fsdp_save_checkpoint.py routes those three
calls here):

- the call copies every tensor of `obj` to host memory (a snapshot: training goes on and updates the
  originals in place), leaves the marker `<path>.writing` and returns;
- one writer thread per process writes the snapshots in order to `<path>.partial`, renames it to
  `<path>`, then removes the marker; a write that fails leaves `<path>.write-failed` (the error) instead;
- the finish (finish.py, which hashes the state and writes its receipt) first waits until no
  `.writing` marker is left under the state (`receipts.wait_for_writes`); a failure marker keeps the state
  without a receipt: incomplete, never resumed from. A kill before the writes end leaves no receipt either.

The files hold host tensors (DTensors with host-local shards under FSDP2), the format of upstream's own
FSDP1 save (`offload_to_cpu=True`) and of torch's `cpu_offload` state dicts: upstream's load
(`torch.load`, then `load_state_dict`) copies them onto the device (tests/test_state_writer.py loads
them through upstream's `load_checkpoint`). Host memory: one state's snapshot per process, page-locked
and kept for the next save (PINNED).
"""

import atexit
import copy
import os
import queue
import threading
import types
from pathlib import Path

import torch

from opd_patches import config
from opd_patches.ops.receipts import FAILED, PARTIAL, WRITING  # the markers; the finish waits on them

# Snapshots of CUDA tensors go to page-locked host memory, several times faster than to pageable memory;
# pinning costs once (the first save), then torch's caching host allocator reuses the blocks, so the
# process keeps one state's size pinned (make bench PHASE=save, docs/performance.md).
PINNED = True


def enabled() -> bool:
    """`opd.background_state_write` in a run's worker. Outside a run (no run folder in the config) upstream
    saves synchronously: only a run's finish waits for the writes before it hashes the state."""
    opd = config.current()
    return opd.background_state_write and opd.run_dir is not None


def snapshot(obj):
    """`obj` with every tensor replaced by a host copy (dicts, lists and tuples walked; other leaves copied)."""
    if isinstance(obj, torch.Tensor):
        return _host(obj.detach())
    if isinstance(obj, dict):
        return type(obj)((k, snapshot(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(snapshot(v) for v in obj)
    return copy.deepcopy(obj)


def _host(t: torch.Tensor) -> torch.Tensor:
    if not (PINNED and t.device.type == "cuda"):
        return t.to("cpu", copy=True)  # a DTensor stays one, with a host-local shard
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    host = torch.empty_like(local, device="cpu", pin_memory=True).copy_(local, non_blocking=True)
    # as torch's own pinned state-dict staging builds it (distributed/_state_dict_utils.py): same spec, host shard
    return DTensor(host, t._spec, requires_grad=False) if isinstance(t, DTensor) else host


class _Writer:
    """One thread, writes in submission order; `_save` is torch.save as imported here (never the proxy)."""

    def __init__(self, save=torch.save):
        self._save = save
        self._jobs: queue.Queue = queue.Queue()
        self._thread = None
        self._lock = threading.Lock()

    def submit(self, obj, path: str, args, kwargs) -> None:
        path = os.fspath(path)
        Path(path + FAILED).unlink(missing_ok=True)
        Path(path + WRITING).write_text(str(os.getpid()))  # before returning: the finish waits for it
        try:
            staged = snapshot(obj)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the copies are done before training touches the originals again
        except BaseException:
            Path(path + WRITING).unlink(missing_ok=True)  # the error reaches upstream's save as its own would
            raise
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="opd-state-writer", daemon=True)
                self._thread.start()
                atexit.register(self.drain)  # a clean interpreter exit writes what it was given first
                print(f"[opd] state files are written by a thread of this worker (opd.background_state_write), "
                      f"first: {path}", flush=True)
        self._jobs.put((staged, path, args, kwargs))

    def drain(self) -> None:
        """Wait until every submitted state file is written (or has failed)."""
        self._jobs.join()

    def _loop(self) -> None:
        while True:
            staged, path, args, kwargs = self._jobs.get()
            try:
                self._save(staged, path + PARTIAL, *args, **kwargs)
                os.replace(path + PARTIAL, path)
            except BaseException as exc:  # noqa: BLE001 - recorded for the finish, never lost
                Path(path + FAILED).write_text(f"{type(exc).__name__}: {exc}")
                Path(path + PARTIAL).unlink(missing_ok=True)
            finally:
                del staged
                Path(path + WRITING).unlink(missing_ok=True)
                self._jobs.task_done()


_WRITER = _Writer()


class _TorchDeferredSave(types.ModuleType):
    """`torch` as upstream's module sees it during a save: the same, except `save` goes to the writer."""

    def __init__(self, writer: _Writer):
        super().__init__("torch")
        self._writer = writer

    def __getattr__(self, name):
        return getattr(torch, name)

    def save(self, obj, f, *args, **kwargs):
        # file objects (the caller owns them) and tensor types the snapshot does not know (FSDP1's
        # ShardedTensor: strategy=fsdp) are written now, as upstream would
        if not isinstance(f, (str, os.PathLike)) or not _plain(obj):
            return torch.save(obj, f, *args, **kwargs)
        self._writer.submit(obj, f, args, kwargs)


def _plain(obj) -> bool:
    """Whether every tensor in `obj` is a torch.Tensor or a DTensor (what `snapshot` copies faithfully)."""
    if isinstance(obj, torch.Tensor):
        from torch.distributed.tensor import DTensor

        return type(obj) in (torch.Tensor, DTensor)
    if isinstance(obj, dict):
        return all(_plain(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_plain(v) for v in obj)
    return True
