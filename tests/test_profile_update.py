"""opd.debug.profile_update: only the N-th update is profiled, its report lands in the run folder."""

import json

import pytest
import torch

from opd_patches import config
from opd_patches.hooks import profile_update
from opd_patches.main import ConfigError, configure_ray
from omegaconf import OmegaConf

from conftest import worker_config_of


class Actor:
    def __init__(self):
        self.calls = []

    def train_mini_batch(self, data):
        x = torch.randn(32, 32, requires_grad=True)
        (x @ x).sum().backward()
        self.calls.append(data)
        return data


class Worker:
    rank = 3

    def __init__(self):
        self.actor = Actor()


def test_only_the_nth_update_is_profiled(tmp_path):
    worker = Worker()
    with config.override(debug={"profile_update": 2}, run_dir=str(tmp_path)):  # as the driver resolves it
        profile_update.install(worker)
        profile_update.install(worker)  # idempotent: one wrapper
    assert [worker.actor.train_mini_batch(i) for i in range(3)] == [0, 1, 2]
    assert worker.actor.calls == [0, 1, 2]
    summary = json.loads((tmp_path / "profile_update_rank3.json").read_text())
    assert summary["update"] == 2 and summary["wall_s"] > 0
    assert any(row["name"] == "aten::mm" for row in summary["top_cpu"])
    assert "aten::mm" in (tmp_path / "profile_update_rank3.txt").read_text()


def test_off_by_default():
    worker = Worker()
    original = worker.actor.train_mini_batch
    profile_update.install(worker)
    assert worker.actor.train_mini_batch == original


@pytest.mark.parametrize("bad", [0, -1, True, "2"])
def test_bad_values_name_the_key(tmp_path, bad):
    composed = OmegaConf.create({"opd": {"teacher_placement": "colocated", "debug": {"profile_update": bad}},
                                 "ray_kwargs": {"ray_init": {}}, "trainer": {"n_gpus_per_node": 1, "nnodes": 1}})
    with pytest.raises(ConfigError, match="opd.debug.profile_update"):
        configure_ray(composed, tmp_path)


def test_the_key_reaches_the_workers_with_the_run_folder(tmp_path):
    """The driver's config carries the update's number and the run folder the reports go to."""
    worker = worker_config_of(tmp_path, debug={"profile_update": 3})
    assert (worker.debug.profile_update, worker.run_dir) == (3, str(tmp_path))
    assert worker_config_of(tmp_path).debug.profile_update is None
