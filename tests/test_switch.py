"""The on/off switches that recipe keys export to the Ray workers (opd_patches/losses/switch.py), tested
once for every switch: unset or empty gives the default, 1/true and 0/false, anything else an error that
names the variable and the recipe key that sets it."""

import pytest

from opd_patches.losses import lean_topk, sampled_logprob
from opd_patches.losses.switch import env_switch

SWITCHES = [(lean_topk, "opd.lean_topk"), (sampled_logprob, "opd.fast_logprobs")]  # module.enabled() reads module.ENV


@pytest.mark.parametrize("default", [True, False])
def test_env_switch_values(monkeypatch, default):
    monkeypatch.delenv("OPD_TEST_SWITCH", raising=False)
    assert env_switch("OPD_TEST_SWITCH", default, "opd.x") is default
    for value, expected in [("", default), ("1", True), ("true", True), ("True", True),
                            ("0", False), ("false", False), ("False", False)]:
        monkeypatch.setenv("OPD_TEST_SWITCH", value)
        assert env_switch("OPD_TEST_SWITCH", default, "opd.x") is expected, value
    monkeypatch.setenv("OPD_TEST_SWITCH", "yes")
    with pytest.raises(ValueError, match=r"OPD_TEST_SWITCH='yes'.*opd\.x"):
        env_switch("OPD_TEST_SWITCH", default, "opd.x")


@pytest.mark.parametrize("module,key", SWITCHES, ids=[k for _, k in SWITCHES])
def test_each_switch_reads_its_env(monkeypatch, module, key):
    monkeypatch.delenv(module.ENV, raising=False)
    assert module.enabled() is module.DEFAULT_ENABLED
    monkeypatch.setenv(module.ENV, "0")
    assert not module.enabled()
    monkeypatch.setenv(module.ENV, "1")
    assert module.enabled()
    monkeypatch.setenv(module.ENV, "maybe")
    with pytest.raises(ValueError, match=rf"{module.ENV}.*{key}"):
        module.enabled()
