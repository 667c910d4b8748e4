"""Both teacher placements get the training-operations mixin (opd_patches/ops/trainer.py)."""

import json
import os
import subprocess
import sys

import pytest

from opd_patches import main
from opd_patches.ops.trainer import OpsTrainerMixin

from test_config import compose_recipe

PROBE = """
import json
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
from opd_patches.ops.trainer import OpsTrainerMixin
print(json.dumps({k: issubclass(TRAINER_REGISTRY[k], OpsTrainerMixin) for k in ("opd_sync", "colocated_teacher")
                  if k in TRAINER_REGISTRY}))
"""


@pytest.mark.parametrize("placement,mode", [("standalone", "opd_sync"), ("colocated", "colocated_teacher")])
def test_placement_picks_a_mode_with_the_mixin(placement, mode):
    c = compose_recipe("k1", f"opd.teacher_placement={placement}")
    main.apply_placement(c)
    assert c.trainer.v1.trainer_mode == mode
    assert c.opd.wall_clock_s is None and c.opd.reserve_s == 1200 and c.opd.validate_after_save is True
    assert c.opd.debug.inject_nan_step is None  # test-only fault injection is off by default


def test_async_standalone_modes_are_left_alone():
    c = compose_recipe("k1", "opd.teacher_placement=standalone", "trainer.v1.trainer_mode=separate_async")
    main.apply_placement(c)
    assert c.trainer.v1.trainer_mode == "separate_async"


@pytest.mark.fresh_process
def test_modes_registered_in_a_fresh_process_through_the_env_var():
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_PLATFORM")}
    env["VERL_USE_EXTERNAL_MODULES"] = "opd_patches.registered,opd_patches.ops.trainer,opd_patches.teacher.trainer"
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {"opd_sync": True, "colocated_teacher": True}


def test_mixin_reports_sync_mode():
    class Probe(OpsTrainerMixin):
        pass

    p = Probe.__new__(Probe)
    p.trainer_mode = "opd_sync"  # upstream's __init__ assigns the configured name
    assert p.trainer_mode == "sync"
