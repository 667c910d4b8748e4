"""opd_patches reaches a process through VERL_USE_EXTERNAL_MODULES, idempotently, and only for the pinned VERL;
a plain `import opd_patches` registers nothing and imports no VERL (the evaluation, data and statistics
commands start without VERL's import cost).

Each check runs in a fresh interpreter: registration is a side effect of import, so an in-process
test would only see whatever an earlier test imported.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import json, verl
    from verl.plugin.platform.platform_manager import PlatformRegistry
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.config.distillation import DistillationTeacherModelConfig
    import torch.distributed
    print(json.dumps({
        "platform_cpu": PlatformRegistry.get("cpu") is not None,
        "replica_hf": "hf" in RolloutReplicaRegistry._registry,
        "rollout_hf": ("hf", "async") in _ROLLOUT_REGISTRY,
        "topk_patch": getattr(DistillationTeacherModelConfig._validate_topk_logprobs, "_opd_patched", False),
        "gloo_patch": getattr(torch.distributed.init_process_group, "_opd_patched", False),
    }))
    """
)


def probe(code=PROBE, **env):
    full_env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_PLATFORM")}
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120)
    return out


@pytest.mark.fresh_process
def test_registered_in_a_fresh_process_through_the_env_var():
    out = probe(VERL_USE_EXTERNAL_MODULES="opd_patches.registered")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == dict.fromkeys(
        ("platform_cpu", "replica_hf", "rollout_hf", "topk_patch", "gloo_patch"), True)


@pytest.mark.fresh_process
def test_nothing_registered_without_the_env_var():
    """Registration must not depend on the silent `verl.plugins` entry point (there is none)."""
    out = probe()
    assert out.returncode == 0, out.stderr
    assert not any(json.loads(out.stdout.splitlines()[-1]).values())


@pytest.mark.fresh_process
def test_register_is_idempotent():
    code = "import opd_patches, verl\n" "opd_patches.register(); opd_patches.register()\n" + PROBE
    out = probe(code, VERL_USE_EXTERNAL_MODULES="opd_patches.registered")
    assert out.returncode == 0, out.stderr
    assert all(json.loads(out.stdout.splitlines()[-1]).values())


def test_wrong_verl_version_fails_with_a_clear_message():
    code = textwrap.dedent(
        """
        import importlib.metadata as md
        real = md.version
        md.version = lambda name: "0.8.0" if name == "verl" else real(name)
        import opd_patches.registered
        """
    )
    out = probe(code)
    assert out.returncode != 0
    assert "pinned to verl==0.9.1 but verl==0.8.0 is installed" in out.stderr
    assert "make install" in out.stderr


def test_importing_the_package_is_cheap():
    """No VERL (nor torch) until something asks for registration; the commands that need neither start fast."""
    code = ("import sys, opd_patches, opd_patches.eval.__main__, opd_patches.data.__main__, opd_patches.stats\n"
            "print(json.dumps({m: m in sys.modules for m in ('verl', 'torch', 'ray')}))")
    out = probe("import json\n" + code, VERL_USE_EXTERNAL_MODULES="opd_patches.registered")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"verl": False, "torch": False, "ray": False}


@pytest.mark.fresh_process
def test_plain_import_registers_nothing():
    out = probe("import opd_patches, verl\n" + PROBE)
    assert out.returncode == 0, out.stderr
    assert not any(json.loads(out.stdout.splitlines()[-1]).values())
