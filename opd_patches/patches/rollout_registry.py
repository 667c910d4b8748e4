"""Changes `verl.workers.rollout.base._ROLLOUT_REGISTRY` (workers/rollout/base.py:89 in VERL 0.9.1): adds
the entry `("hf", "async")`.

Why: the `hf` rollout's in-worker class (opd_patches/rollout/hf.py `HFServerAdapter`) has no public
hook: `get_rollout_class` resolves a rollout name through this private dict, where upstream's own backends
are listed by dotted path. (The replica side goes through the public `RolloutReplicaRegistry.register`.)
"""

from opd_patches.patches import registry
from opd_patches.patches.registry import Upstream

KEY = ("hf", "async")
CLASS = "opd_patches.rollout.hf.HFServerAdapter"
CHANGES = (Upstream("verl.workers.rollout.base", "_ROLLOUT_REGISTRY", key=KEY),)
RELIES_ON = (
    Upstream("verl.workers.rollout.base", "get_rollout_class", params=("rollout_name", "mode"),
             source=("fqdn = _ROLLOUT_REGISTRY[(rollout_name, mode)]",
                     'module_name, class_name = fqdn.rsplit(".", 1)')),
)


def apply():
    from verl.workers.rollout import base

    return registry.apply(__name__, base, "_ROLLOUT_REGISTRY", lambda original: CLASS, key=KEY)
