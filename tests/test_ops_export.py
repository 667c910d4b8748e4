"""The HF export loads where opd_patches is not registered (opd_patches/ops/export.py, ops/finish.py).

VERL writes `actor_rollout_ref.model.override_config` into the export's config.json, so a run under
`opd.attn_implementation=torch_varlen` (the default on CUDA without flash-attn) produced exports that
plain transformers refused to load; the first H200 run's validation failed on exactly that.
"""

import json
import shutil

import pytest

from opd_patches.attention import torch_varlen
from opd_patches.ops import export, finish, receipts


def _state_with_export(tmp_path, model_dir, attn):
    state = tmp_path / "global_step_1"
    hf = state / receipts.HF_EXPORT
    shutil.copytree(model_dir, hf)
    config = json.loads((hf / "config.json").read_text())
    config["attn_implementation"] = attn
    (hf / "config.json").write_text(json.dumps(config))
    return state, hf


def test_project_only_names_are_the_registered_ones():
    assert export.PROJECT_ONLY == {torch_varlen.NAME}


@pytest.mark.fresh_process
def test_finish_makes_a_torch_varlen_export_loadable(tmp_path, embedded):
    state, hf = _state_with_export(tmp_path, embedded["student"], torch_varlen.NAME)
    out = finish.finish(state, 1, validate=True, expected_params=None, timeout_s=600)
    assert out["validation"]["ok"] is True, out["validation"]  # loaded by transformers in a fresh CPU process
    assert "attn_implementation" not in json.loads((hf / "config.json").read_text())
    assert receipts.verify(state) == []  # hashed after the rewrite


def test_builtin_attention_is_left_as_saved(tmp_path, embedded):
    _, hf = _state_with_export(tmp_path, embedded["student"], "sdpa")
    before = (hf / "config.json").read_bytes()
    assert export.make_portable(hf) == []
    assert (hf / "config.json").read_bytes() == before
