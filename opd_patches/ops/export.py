"""The HF export as users load it: no training-only setting left in its config.json.

VERL copies `actor_rollout_ref.model.override_config` into the model config it saves with each HF
export, so `opd.attn_implementation`'s `torch_varlen` (registered in transformers by opd_patches
in the training processes only) lands in `config.json` as `"attn_implementation": "torch_varlen"`.
transformers then refuses to load the export anywhere that registration is absent (the export
validation fails with "Specified `attn_implementation="torch_varlen"` is not supported").
`make_portable` drops that key when it names an implementation of this project, before validation
and hashing (ops/finish.py), so the export loads with transformers' default attention everywhere.
"""

import json
import os
from pathlib import Path

# Attention implementations only opd_patches registers (backends/torch_varlen.py NAME; not imported
# here: that module imports torch, and the finish subprocess should start fast). A test keeps them equal.
PROJECT_ONLY = {"torch_varlen"}


def make_portable(export: Path) -> list[str]:
    """Remove project-only settings from `export/config.json` (atomically); returns the keys removed."""
    path = Path(export) / "config.json"
    if not path.is_file():
        return []
    config = json.loads(path.read_text())
    removed = [k for k in ("attn_implementation", "_attn_implementation") if config.get(k) in PROJECT_ONLY]
    if removed:
        for key in removed:
            config.pop(key)
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    return removed
