"""Both teacher placements get the training-operations mixin (opd_patches/trainers/opd_sync.py)."""

import pytest

from opd_patches import main
from opd_patches.trainers.opd_sync import OpsTrainerMixin

from fresh_verl import facts
from test_config import compose_recipe


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
@pytest.mark.parametrize("env,mode", [("standalone", "opd_sync"), ("colocated", "colocated_teacher")])
def test_modes_registered_in_a_fresh_process_through_the_env_var(env, mode):
    """Each placement's Ray processes (main.configure_ray's VERL_USE_EXTERNAL_MODULES) get its mode, with the mixin."""
    assert facts(env)["modes"][mode][1] is True


def test_mixin_reports_sync_mode():
    class Probe(OpsTrainerMixin):
        pass

    p = Probe.__new__(Probe)
    p.trainer_mode = "opd_sync"  # upstream's __init__ assigns the configured name
    assert p.trainer_mode == "sync"
