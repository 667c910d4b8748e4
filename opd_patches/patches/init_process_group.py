"""Changes `torch.distributed.init_process_group` (torch/distributed/distributed_c10d.py).

Why: VERL builds the process-group backend as `f"cpu:gloo,{device}:{backend}"`
(verl/utils/distributed.py); on the CPU platform that names the CPU twice and torch refuses it
("Duplicate device type"). The wrapper drops repeated `device:backend` entries.
It also retries a single-rank env:// rendezvous whose MASTER_PORT was taken (EADDRINUSE): VERL's rank-0
worker picks a free port (bind to 0, close) before torch listens on it, and another process's connection
can take it meanwhile. With one rank nobody else dials that port, so a fresh one is as good; with several
ranks it raises as before.
Accepts: every backend torch accepts reaches it as the same object (only strings that torch refuses as
"Duplicate device type" change); positional, keyword and absent `backend` pass through.
"""

import functools
import os

from opd_patches.patches import registry
from opd_patches.patches.registry import Upstream

# The wrapper reads backend, init_method and world_size by position (store by keyword only, as upstream calls it).
CHANGES = (Upstream("torch.distributed", "init_process_group",
                    params=("backend", "init_method", "timeout", "world_size", "rank", "store", "...")),)
RELIES_ON = (
    Upstream("verl.utils.distributed", "initialize_global_process_group",
             source=('f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"',)),
    Upstream("verl.utils.distributed", "initialize_global_process_group_ray",
             source=('f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"',)),
    Upstream("verl.single_controller.base.worker", "WorkerHelper._get_free_port"),
)
PORT_RETRIES = 3


def dedupe_backend(backend):
    """'cpu:gloo,cpu:gloo' -> 'cpu:gloo'. Only repeated `device:backend` entries are dropped, which torch
    refuses ("Duplicate device type"), so every value torch accepts comes back as the same object."""
    if not isinstance(backend, str) or "," not in backend:
        return backend
    parts = backend.split(",")
    unique = list(dict.fromkeys(parts))
    if len(unique) == len(parts) or not all(":" in part for part in parts):
        return backend
    return ",".join(unique)


def _single_rank_env(args, kwargs) -> bool:
    """A one-rank group rendezvousing through MASTER_ADDR/MASTER_PORT (init_method None or env://, no store)."""
    init_method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
    if kwargs.get("store") is not None or init_method not in (None, "env://"):
        return False
    world_size = kwargs.get("world_size", args[3] if len(args) > 3 else -1)
    if world_size in (-1, None):
        world_size = os.environ.get("WORLD_SIZE")
    return str(world_size) == "1"


def _wrap(original):
    import torch.distributed

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = dedupe_backend(kwargs["backend"])
        elif args:
            args = (dedupe_backend(args[0]),) + args[1:]
        for attempt in range(PORT_RETRIES + 1):
            try:
                return original(*args, **kwargs)
            except torch.distributed.DistNetworkError as exc:
                if attempt == PORT_RETRIES or "EADDRINUSE" not in str(exc) or not _single_rank_env(args, kwargs):
                    raise
                from verl.single_controller.base.worker import WorkerHelper  # how VERL picked the taken one

                taken, os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT"), str(WorkerHelper._get_free_port())
                print(f"[opd] MASTER_PORT {taken} was taken before torch listened on it; single rank: "
                      f"retrying on {os.environ['MASTER_PORT']}", flush=True)

    return init_process_group


def apply():
    import torch.distributed

    return registry.apply(__name__, torch.distributed, "init_process_group", _wrap)
