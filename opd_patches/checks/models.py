"""A model reference checked before anything loads it: `check_model(path, key)`.

A local folder must hold `config.json`, weights (`*.safetensors` or `*.bin`, sharded or not) and a tokenizer
(`tokenizer.json`, or `tokenizer_config.json` with its vocabulary files) whose chat template is set
(`chat_template` in tokenizer_config.json, or `chat_template.jinja`/`.json`): training renders prompts
with it and the evaluation renders them the same way. A name of the form `org/name` that is no local
folder is a Hugging Face hub id: these machines have no network, so it must already be in the local
cache (`huggingface_hub`'s, i.e. $HF_HOME); the cached snapshot is then checked as a folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from opd_patches.checks import InputError

WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def looks_like_hub_id(path: str) -> bool:
    return not path.startswith(("/", ".", "~")) and path.count("/") == 1 and not os.path.exists(path)


def _cached_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001  (not cached, or an invalid id: both mean "not here")
        return None


def check_model(path, key: str) -> Path:
    """The local folder of model `path` (given as `key`, e.g. STUDENT / actor_rollout_ref.model.path), checked."""
    text = str(path)
    where = f"{key}={text}"
    if looks_like_hub_id(text):
        folder = _cached_snapshot(text)
        if folder is None:
            raise InputError(f"{where}: no such local folder, and the hub id is not in the local Hugging Face cache "
                             f"(this machine cannot download). Point {key} at a model folder, or download it on a "
                             f"machine with network (huggingface-cli download {text}) and copy the cache.")
    else:
        folder = Path(os.path.expanduser(text))
        if not folder.exists():
            raise InputError(f"{where}: no such file or directory. Point {key} at a Hugging Face model folder "
                             "(config.json, weights, tokenizer).")
        if not folder.is_dir():
            raise InputError(f"{where}: is a file, not a model folder (config.json, weights, tokenizer).")
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(any(folder.glob(p)) for p in WEIGHTS):
        missing.append("weights (*.safetensors or *.bin)")
    if not any((folder / f).is_file() for f in TOKENIZER):
        missing.append("a tokenizer (tokenizer.json or tokenizer_config.json)")
    if missing:
        raise InputError(f"{where}: the folder {folder} lacks {', '.join(missing)}; a model folder as "
                         "save_pretrained writes it is needed (for a checkpoint: its actor/huggingface export).")
    try:
        json.loads((folder / "config.json").read_text())
    except ValueError as exc:
        raise InputError(f"{where}: {folder / 'config.json'} is not valid JSON ({exc}).") from None
    if not _has_chat_template(folder):
        raise InputError(f"{where}: the tokenizer in {folder} has no chat template (tokenizer_config.json "
                         "`chat_template`, or chat_template.jinja). Training and evaluation render prompts with it: "
                         "add the model family's template.")
    return folder


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(cfg.get("chat_template"))
