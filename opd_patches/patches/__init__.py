"""Every run-time patch of upstream code (VERL 0.9.1, torch): one file per patch, named for what it changes.

A patch is any change of upstream behaviour made from outside: a replaced function or method, a wrapped
instance method, an overwritten attribute of an upstream object, a temporary module-global swap, a write
into an upstream registry's private table. Each goes through `registry.apply` / `registry.swapped`, which
record it; each file's docstring names the upstream symbol it changes and why, and its `CHANGES` /
`RELIES_ON` declarations are what tests/test_upstream_patches.py checks against the installed upstream.

`apply_all()` (called by `opd_patches.register()`) applies the patches made once per process, in the
order of AT_REGISTRATION (entropy_from_logits and fsdp_save_checkpoint only where their switch is on;
fsdp_save_checkpoint's `deferred_saves` is the temporary swap of the checkpoint manager's module-global
`torch`). The ON_DEMAND ones are applied by the code that owns the object they change:
- replay_poll_interval, replay_wait_for_next_poll: the trainer mixin (opd_patches/trainers/opd_sync.py,
  ops/liveness.py), on its replay buffer;
- train_mini_batch: opd.debug.profile_update (opd_patches/hooks/profile_update.py), on the worker's actor.
Importing this package imports neither VERL nor torch.
"""

import importlib

AT_REGISTRATION = (
    "init_process_group",
    "validate_topk_logprobs",
    "compute_forward_kl_topk",
    "forward_kl_topk_registry",
    "logprobs_from_logits_v2",
    "distillation_ppo_loss",
    "entropy_from_logits",
    "fsdp_save_checkpoint",
    "rollout_registry",
)
ON_DEMAND = ("replay_poll_interval", "replay_wait_for_next_poll", "train_mini_batch")
ALL = AT_REGISTRATION + ON_DEMAND  # every patch file of this package (tests check the folder against it)


def module(name: str):
    """The patch file `name` (imported)."""
    if name not in ALL:
        raise KeyError(f"no run-time patch {name!r}; patches: {', '.join(ALL)}")
    return importlib.import_module(f"{__name__}.{name}")


def apply_all() -> None:
    """Apply every patch made at registration (each is idempotent; some only where their switch is on)."""
    for name in AT_REGISTRATION:
        module(name).apply()
