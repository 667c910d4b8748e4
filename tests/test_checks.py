"""Bad loss settings and incompatible models are refused before any worker starts, naming the key."""

import json
import shutil

import pytest

import opd_patches  # noqa: F401  (registers forward_kl_topk_tail, which the error lists)
from opd_patches import main
from opd_patches.checks import compat

from composed import compose_recipe


def composed(embedded, recipe, *overrides, teacher=None):
    return compose_recipe(
        recipe,
        f"actor_rollout_ref.model.path={embedded['student']}",
        f"distillation.teacher_models.teacher_model.model_path={teacher or embedded['teacher']}",
        f"data.train_files={embedded['train']}", f"data.val_files={embedded['val']}",
        "+device=cpu", *overrides,
    )


@pytest.mark.parametrize("recipe", ["k1", "topk", "topk_tail"])
def test_recipes_pass_on_the_embedded_models(embedded, recipe):
    main.check_distillation(composed(embedded, recipe))


def test_unknown_loss_mode_lists_the_registered_ones(embedded):
    with pytest.raises(main.ConfigError, match=r"Unsupported loss mode: nope.*forward_kl_topk_tail"):
        main.check_distillation(composed(embedded, "topk", "distillation.distillation_loss.loss_mode=nope"))


@pytest.mark.parametrize("topk", [0, -3, 449, 10_000])
def test_topk_outside_the_vocabulary(embedded, topk):
    with pytest.raises(main.ConfigError, match=rf"distillation\.distillation_loss\.topk={topk}:.*448"):
        main.check_distillation(composed(embedded, "topk_tail", f"distillation.distillation_loss.topk={topk}"))


def test_k1_without_policy_gradient(embedded):
    with pytest.raises(main.ConfigError, match="Directly backpropagating k1 loss"):
        main.check_distillation(composed(embedded, "k1", "distillation.distillation_loss.use_policy_gradient=false"))


def test_vocabulary_mismatch_names_the_teacher(embedded, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(embedded["teacher"], teacher)
    # Swap two token ids in the teacher's tokenizer: same size, different map.
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "0", "1"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(main.ConfigError, match=r"teacher_models\.teacher_model\.model_path: tokenizers differ"):
        main.check_distillation(composed(embedded, "topk", teacher=teacher))


def test_vocab_size_mismatch(embedded, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(embedded["teacher"], teacher)
    cfg = json.loads((teacher / "config.json").read_text())
    cfg["vocab_size"] += 64
    (teacher / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(compat.IncompatibleModels, match="vocab_size differs"):
        compat.check_vocab(str(embedded["student"]), str(teacher))


def test_unavailable_hub_id_is_not_checked(embedded):
    out = compat.check_vocab(str(embedded["student"]), "nobody/not-a-cached-model")
    assert out["checked"] is False and "not available locally" in out["reason"]
