"""Start-up does each thing once: every model's tokenizer is loaded once by the driver's checks
(vocabulary, then the pre-flight's chat-template and step-0 checks share the loaded tokenizers)."""

from collections import Counter

import pytest
from hydra import compose, initialize_config_dir

from conftest import REPO


def _composed(embedded, run_dir, *overrides):
    with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base=None):
        return compose(config_name="topk", overrides=[
            "hydra.searchpath=[pkg://verl.trainer.config]",
            f"actor_rollout_ref.model.path={embedded['student']}",
            f"distillation.teacher_models.teacher_model.model_path={embedded['teacher']}",
            f"data.train_files={embedded['train']}", f"data.val_files={embedded['val']}",
            f"trainer.default_local_dir={run_dir}", "+device=cpu", *overrides,
        ])


@pytest.mark.parametrize("mode", ["off", "cheap", "full"])
def test_prepare_loads_each_tokenizer_once(embedded, tmp_path, monkeypatch, mode):
    from transformers import AutoTokenizer

    from opd_patches import main

    loads = Counter()
    real = AutoTokenizer.from_pretrained.__func__

    def counted(cls, path, *args, **kwargs):  # the real loader, counted
        loads[str(path)] += 1
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    run_dir = main.prepare(_composed(embedded, tmp_path / "run", f"opd.preflight={mode}"))
    assert loads == {str(embedded["student"]): 1, str(embedded["teacher"]): 1}, loads
    assert (run_dir / "preflight.json").exists() == (mode != "off")
