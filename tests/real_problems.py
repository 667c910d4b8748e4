"""Where the tests that need real competition problems read them ({id, problem, answer} JSONL files
math500, aime24, aime25), in place, never copied into the repository.

The reference folder beside the checkout (../shared/data/math) where there is one, else the evaluation
data folder that `make data-eval` fills ($OPD_EVAL_DATA, else ~/data/opd-eval). Where neither holds a
file, the test skips with `missing(path)`, which names the command that fetches the sets.
"""

from pathlib import Path

from opd_patches.data.eval_sets import EXAMPLE
from opd_patches.eval.suites import default_data_dir

REPO = Path(__file__).resolve().parents[1]
BESIDE = REPO.parent / "shared" / "data" / "math"
FETCH = f'make data-eval EVAL_SETS="{EXAMPLE}"'


def _data_dir() -> Path:
    for folder in (BESIDE, default_data_dir()):
        if (folder / "math500.jsonl").is_file():
            return folder
    return BESIDE


DATA = _data_dir()


def missing(path: Path) -> str:
    return (f"{path} is missing: this test reads the real MATH-500 / AIME 2024 / AIME 2025 problems from "
            f"{BESIDE} (beside the checkout) or, where that is absent, the evaluation data folder "
            f"{default_data_dir()} ($OPD_EVAL_DATA); fill the latter with {FETCH}")
