"""A one-rank gloo process group for in-process tests of VERL code (FSDP engines, checkpoint managers)."""

import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def single_rank_gloo(tmp_path_factory):
    """Creates the group unless one exists (several test modules share a pytest process) and removes only its own."""
    created = not dist.is_initialized()
    if created:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()
