"""Checks before a run starts. Inputs refused at the door: data files, model folders and evaluation suites checked before Ray, vLLM or
a model load start (opd_patches.main for training, opd_patches.eval for `make eval`, opd_patches.data for
`make data`). Every refusal is an `InputError` whose message names the file (and row, column or key), what
was found and the fix; the callers print it as one block and exit with status 2, without a traceback.

- data.py: VERL's RL parquet (train/val files), `make data` sources, evaluation-suite JSONL;
- models.py: a model reference (local folder, or a hub id already in the local cache);
- resources.py: the disk for the kept states and the host memory for the saves' snapshot and the parked teacher;
- compat.py: student and teacher can be distilled (one tokenizer, one chat template);
- compilation.py: the rollout engine's compilation_config (CUDA-graph modes that changed the samples);
- speculation.py: upstream's `speculative_config` for the rollout, where it can work (the vLLM rollout, a method vLLM knows);
- preflight.py: `make preflight` and opd.preflight (the compatibility report, optionally step-0 statistics).
"""


class InputError(ValueError):
    """An input that cannot work; the message names it and says what to do."""
