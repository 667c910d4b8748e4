"""opd_patches: on-policy distillation for VERL, added only through VERL's own extension hooks.

`register()` registers (idempotently):
- the `cpu` platform (`PlatformRegistry`, selected by `VERL_PLATFORM=cpu`);
- the `hf` rollout backend (`RolloutReplicaRegistry` and the `("hf", "async")` rollout class);
- the distillation loss `forward_kl_topk_tail` (`register_distillation_loss`);
- the run-time patches of `opd_patches.patches` made at registration (its `apply_all`; the `("hf", "async")`
  rollout class among them);
- the attention implementation `torch_varlen` (transformers' `AttentionInterface`, `backends.torch_varlen`).

Importing this package registers nothing and does not import VERL, so the evaluation, data and
statistics commands start without VERL's import cost. Every VERL process registers through
`VERL_USE_EXTERNAL_MODULES=opd_patches.registered` (a module whose import calls `register()`; run.sh
sets the variable and main.py passes it to Ray workers); `register()` fails loudly if the installed
VERL is not the pinned one.
"""

from importlib.metadata import PackageNotFoundError, version

VERL_VERSION = "0.9.1"


def _check_verl_version():
    try:
        found = version("verl")
    except PackageNotFoundError as exc:
        raise ImportError(f"opd_patches needs verl=={VERL_VERSION}, which is not installed: run `make install`.") from exc
    if found != VERL_VERSION:
        raise ImportError(
            f"opd_patches is pinned to verl=={VERL_VERSION} but verl=={found} is installed; its hooks and "
            f"patches were written against {VERL_VERSION}. Run `make install` (or pip install verl=={VERL_VERSION})."
        )


def register():
    """Register everything with VERL; safe to call more than once (the single entry point)."""
    _check_verl_version()
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from opd_patches import patches
    from opd_patches.attention import torch_varlen
    from opd_patches.platforms import cpu as cpu_platform  # noqa: F401  (registers "cpu")
    from opd_patches.losses import forward_kl_topk_tail  # noqa: F401  (registers the loss)

    patches.apply_all()
    torch_varlen.register()  # attention "torch_varlen" in transformers' registries (packed inputs, no flash-attn)

    def _load_hf_replica():
        from opd_patches.rollout.hf import HFReplica

        return HFReplica

    RolloutReplicaRegistry.register("hf", _load_hf_replica)
