"""Wall-clock decisions (opd_patches/ops/budget.py) and the non-finite guard (guard.py), on a fake clock."""

import math

import pytest
import torch

from opd_patches.ops.budget import WallClock
from opd_patches.ops.nonfinite import NonFiniteError, check_metrics, check_tensor


class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def clock(wall=100.0, reserve=10.0, margin=1.5):
    fake = FakeClock()
    return WallClock(wall, reserve_s=reserve, margin=margin, launched_at=fake.t, clock=fake), fake


def test_no_wall_clock_never_stops():
    w = WallClock(None)
    w.record_step(1e9)
    assert w.should_stop() == (False, "") and w.remaining() == math.inf


def test_stops_when_next_step_and_save_do_not_fit():
    w, t = clock(wall=100, reserve=10, margin=1.5)  # deadline: 90 s after launch
    t.t += 40
    w.record_step(10)  # no save measured yet: the step time stands in for it -> need 1.5 * 20 = 30
    assert w.should_stop()[0] is False  # 50 s left
    t.t += 25
    stop, why = w.should_stop()  # 25 s left < 30
    assert stop and "25 s left" in why and "reserve_s=10" in why
    w.record_save(5)  # measured save: need 1.5 * (10 + 5) = 22.5 < 25
    assert w.should_stop()[0] is False
    assert w.should_stop(pending_save=True)[0] is True  # this step's own save first: 22.5 + 7.5 > 25



def test_background_finish_in_flight_counts():
    w, t = clock(wall=100, reserve=10, margin=1.0)  # deadline: 90 s after launch
    w.record_step(10)
    w.record_save(4 + 20)  # a whole save: 4 s waited + 20 s finishing in the background
    t.t += 50  # 40 s left; the next step and its (final, waited-for) save need 10 + 24 = 34
    assert w.should_stop()[0] is False
    # A finish still running, 5 s old: 19 s of it are left and the final save waits for it -> 53 > 40.
    stop, why = w.should_stop(in_flight_s=5)
    assert stop and "need ~53 s" in why
    assert w.should_stop(in_flight_s=24)[0] is False  # about done: nothing left of it counts


def test_clock_running_out_mid_step_stops_right_after_it():
    w, t = clock(wall=30, reserve=0)
    t.t += 5
    assert w.exhausted_before_start() == (False, "")
    t.t += 60  # one step took far longer than the whole clock
    w.record_step(60)
    stop, why = w.should_stop()
    assert stop and "deadline has passed" in why
    assert w.exhausted_before_start()[0] is True


def test_slowest_recent_step_is_the_prediction():
    w, _ = clock()
    for s in (1, 9, 2):
        w.record_step(s)
    w.record_save(4)
    assert w.predicted() == pytest.approx(1.5 * (9 + 4))


@pytest.mark.parametrize("bad", [{"wall_clock_s": 0}, {"wall_clock_s": 10, "reserve_s": -1}, {"wall_clock_s": 10, "margin": 0.5}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="opd."):
        WallClock(**bad)


def test_guard_names_step_and_quantity():
    ok = {"actor/loss": 0.1, "actor/grad_norm": 2.0, "timing_s/step": float("nan"), "response_length/mean": 3}
    check_metrics(ok, 3)  # a NaN outside the watched quantities is not the guard's business
    for name in ("actor/loss", "actor/pg_loss", "actor/distillation/loss", "actor/grad_norm",
                 "actor/distillation/teacher_mass"):
        with pytest.raises(NonFiniteError) as exc:
            check_metrics({**ok, name: float("inf") if "grad" in name else float("nan")}, 7)
        assert exc.value.step == 7 and exc.value.quantity == name
        assert f"at step 7" in str(exc.value) and name in str(exc.value)
    # Several non-finite: the headline quantity is named.
    with pytest.raises(NonFiniteError) as exc:
        check_metrics({"actor/distillation/abs_loss": math.nan, "actor/loss": math.nan, "actor/grad_norm": math.nan}, 1)
    assert exc.value.quantity == "actor/loss"


def test_guard_on_teacher_tensors_dense_and_jagged():
    good = torch.nested.as_nested_tensor([torch.zeros(3, 2), torch.ones(5, 2)], layout=torch.jagged)
    check_tensor(good, 1, "teacher output")
    bad = torch.nested.as_nested_tensor([torch.zeros(3, 2), torch.tensor([[0.0, float("nan")]])], layout=torch.jagged)
    with pytest.raises(NonFiniteError, match="teacher output .*1 of 8 values.* at step 4"):
        check_tensor(bad, 4, "teacher output")
    with pytest.raises(NonFiniteError):
        check_tensor(torch.tensor([1.0, -float("inf")]), 2, "teacher output")
