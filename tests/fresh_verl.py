"""What a fresh process that imports VERL sees (a Ray worker's view), one interpreter per environment,
shared by the tests that read it.

Registration is a side effect of import (`import verl` imports the modules named in
VERL_USE_EXTERNAL_MODULES), so the pytest process would only show what earlier tests imported. Each
environment below starts one interpreter per session (importing torch and VERL: ~8-10 s on 2 cores),
which reports every fact the tests ask about as one JSON line; `facts(name)` returns it.
"""

import functools
import json
import os
import subprocess
import sys

from opd_patches import config

# The environments main.configure_ray gives Ray processes (colocated / standalone teacher), the
# registration module alone, and none (no variable: what VERL does without opd_patches asking for it).
ENVS = {
    "none": {},
    "registered": {"VERL_USE_EXTERNAL_MODULES": "opd_patches.registered"},
    "colocated": {"VERL_USE_EXTERNAL_MODULES": "opd_patches.registered,opd_patches.trainers.colocated_teacher",
                  **config.env(entropy_detached=True)},  # the skipped old-log-prob pass of the recipes
    "standalone": {"VERL_USE_EXTERNAL_MODULES": "opd_patches.registered,opd_patches.trainers.opd_sync"},
}
REGISTRATION = ("platform_cpu", "replica_hf", "rollout_hf", "topk_patch", "gloo_patch")

FACTS = """
import json
import opd_patches  # a plain import: registers nothing by itself
import verl  # imports the modules named in VERL_USE_EXTERNAL_MODULES
from verl.plugin.platform import platform_manager
facts = {"platform_fixed": platform_manager._current_platform is not None}  # before the imports below fix it

def registration():
    import torch.distributed
    from verl.plugin.platform.platform_manager import PlatformRegistry
    from verl.workers.config.distillation import DistillationTeacherModelConfig
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    return {
        "platform_cpu": PlatformRegistry.get("cpu") is not None,
        "replica_hf": "hf" in RolloutReplicaRegistry._registry,
        "rollout_hf": ("hf", "async") in _ROLLOUT_REGISTRY,
        "topk_patch": getattr(DistillationTeacherModelConfig._validate_topk_logprobs, "_opd_patched", False),
        "gloo_patch": getattr(torch.distributed.init_process_group, "_opd_patched", False),
    }

facts["registration"] = registration()
import torch
import verl.utils.torch_functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
modes = {k: TRAINER_REGISTRY[k] for k in ("opd_sync", "colocated_teacher") if k in TRAINER_REGISTRY}
from opd_patches.trainers.opd_sync import OpsTrainerMixin  # registers opd_sync itself: read the registry first

facts["logprobs_patched"] = getattr(F.logprobs_from_logits_v2, "_opd_patched", False)
facts["torch_varlen"] = ["torch_varlen" in AttentionInterface._global_mapping,
                         "torch_varlen" in AttentionMaskInterface._global_mapping]
facts["modes"] = {k: [cls.__name__, issubclass(cls, OpsTrainerMixin)] for k, cls in modes.items()}
z = torch.randn(5, 11, requires_grad=True)
facts["entropy_detached"] = {
    f.__name__: bool(getattr(f, "_opd_patched", False)) and not f(z).requires_grad
    and torch.equal(f(z), f.__wrapped__(z).detach())
    for f in (F.entropy_from_logits, F.entropy_from_logits_with_chunking)}
opd_patches.register(); opd_patches.register()  # idempotent: nothing raises, nothing changes
facts["registration_again"] = registration()
print(json.dumps(facts))
"""


@functools.cache
def facts(env: str) -> dict:
    """The FACTS of a fresh interpreter in environment ENVS[env] (VERL_PLATFORM unset, as in a new shell)."""
    full = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_PLATFORM",
                                                                      config.ENV)}
    full.update(ENVS[env])
    out = subprocess.run([sys.executable, "-c", FACTS], env=full, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{env}: exit {out.returncode}\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.splitlines()[-1])
