"""Recipes composed as run.sh composes them: Hydra's compose API on recipes/ with VERL's ppo_trainer on
the search path, plus the caller's overrides.

One composition costs about a second here (YAML parsing and merging of ~70 files) and the suite asks for
the same one several times, so each is made once per process and every call gets its own deep copy
(callers mutate them, e.g. main.prepare). A composition that fails raises every time (not cached).
"""

import copy
import functools
from pathlib import Path

from hydra import compose, initialize_config_dir

from opd_patches import config  # noqa: F401  (registers recipes/base.yaml's opd_defaults node)

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SEARCH_PATH = "hydra.searchpath=[pkg://verl.trainer.config]"  # as run.sh


@functools.lru_cache(maxsize=None)
def _composed(recipe: str, overrides: tuple[str, ...]):
    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return compose(config_name=recipe, overrides=[SEARCH_PATH, *overrides])


def compose_recipe(recipe: str, *overrides: str):
    """recipes/RECIPE.yaml composed with `overrides` (a fresh copy)."""
    return copy.deepcopy(_composed(recipe, tuple(str(o) for o in overrides)))


PLACEHOLDERS = ("actor_rollout_ref.model.path=/models/student",
                "distillation.teacher_models.teacher_model.model_path=/models/teacher",
                "data.train_files=/data/train.parquet", "data.val_files=/data/val.parquet")


def compose_placeholder(recipe: str, *overrides: str, device: str = "cpu"):
    """`recipe` on a device profile with placeholder model and data paths (nothing is read from them)."""
    return compose_recipe(recipe, *PLACEHOLDERS, f"+device={device}", *overrides)
