"""Guards for the two run-time patches in opd_patches/backends/upstream_patches.py.

If one of these fails after a VERL or torch upgrade, the patched upstream code moved or changed:
re-read it, then adapt or delete the patch. Do not loosen the assertions.
"""

import inspect
import subprocess
import sys
import textwrap

import pytest
import verl.utils.distributed as verl_distributed
from verl.workers.config import RolloutConfig
from verl.workers.config.distillation import DistillationTeacherModelConfig
from verl.workers.rollout import base as rollout_base

import opd_patches  # noqa: F401
from opd_patches.backends.upstream_patches import dedupe_backend


def test_verl_still_builds_the_duplicated_backend_string():
    for fn in (verl_distributed.initialize_global_process_group, verl_distributed.initialize_global_process_group_ray):
        assert 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"' in inspect.getsource(fn), fn.__name__


def test_dedupe_backend():
    assert dedupe_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert dedupe_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert dedupe_backend("gloo") == "gloo"
    assert dedupe_backend(None) is None


def test_torch_refuses_the_duplicate_and_accepts_it_patched(tmp_path):
    """A real single-rank gloo group, with and without the patch, in fresh processes."""
    code = textwrap.dedent(
        f"""
        import sys, torch.distributed as dist
        if sys.argv[1] == "patched":
            from opd_patches.backends import upstream_patches; upstream_patches.apply()
        dist.init_process_group(backend="cpu:gloo,cpu:gloo", init_method="file://{tmp_path}/" + sys.argv[1],
                                rank=0, world_size=1)
        dist.all_reduce(__import__("torch").ones(1)); print("ok")
        """
    )
    plain = subprocess.run([sys.executable, "-c", code, "plain"], capture_output=True, text=True, timeout=60)
    patched = subprocess.run([sys.executable, "-c", code, "patched"], capture_output=True, text=True, timeout=60)
    assert plain.returncode != 0 and "Duplicate device type cpu" in plain.stderr
    assert patched.returncode == 0 and patched.stdout.strip() == "ok", patched.stderr


def _teacher(name):
    return DistillationTeacherModelConfig(key="t", model_path="/m", inference=RolloutConfig(name=name))


def test_upstream_topk_validation_still_rejects_unknown_engines():
    original = DistillationTeacherModelConfig._validate_topk_logprobs.__wrapped__
    with pytest.raises(NotImplementedError, match="does not support inference engine hf"):
        original(_teacher("hf"), use_topk=True, topk=16)


def test_patched_topk_validation_accepts_hf_only():
    _teacher("hf")._validate_topk_logprobs(use_topk=True, topk=16)
    with pytest.raises(ValueError, match="topk must be specified"):
        _teacher("hf")._validate_topk_logprobs(use_topk=True, topk=None)
    with pytest.raises(NotImplementedError):
        _teacher("trtllm")._validate_topk_logprobs(use_topk=True, topk=16)


def test_rollout_class_registry_is_still_the_private_dict():
    assert isinstance(rollout_base._ROLLOUT_REGISTRY, dict) and ("vllm", "async") in rollout_base._ROLLOUT_REGISTRY
    from opd_patches.backends.hf_rollout import HFServerAdapter

    assert rollout_base.get_rollout_class("hf", "async") is HFServerAdapter
