"""The run manifest: what produced a run folder, written before training starts.

`manifest.json` holds the resolved config, the pinned VERL wheel and its sha256, the versions
of the packages that shape the numbers, the seeds, the project's git commit (and whether the
tree was dirty), the command line and the host. A relaunch in the same folder (a resume)
keeps the earlier manifest and metrics as `manifest.1.json`, `metrics.1.jsonl`, ...
"""

import json
import os
import platform
import socket
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("verl", "torch", "transformers", "tokenizers", "ray", "tensordict", "vllm", "flash-attn", "opd-patches")


def rotate(path: Path) -> None:
    """Move `path` aside to the first free `<stem>.<n><suffix>` so that nothing is overwritten."""
    if not path.exists():
        return
    n = 1
    while (aside := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(aside)


def _git(*args: str):
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> dict:
    """{commit, dirty} of this checkout (None / False outside a git checkout)."""
    return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain"))}


def versions(names=PACKAGES) -> dict:
    """{package: installed version or None} of `names`."""
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def _verl_pin() -> dict:
    pin = REPO / "verl_vendor" / "pin.toml"
    if not pin.exists():
        return {}
    sys.path.insert(0, str(pin.parent))
    try:
        from vendor import load_pin
    finally:
        sys.path.pop(0)
    return load_pin(pin)


def build(config: DictConfig) -> dict:
    cfg = OmegaConf.to_container(config, resolve=True)
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": sys.argv,
        "host": {"name": socket.gethostname(), "python": platform.python_version(), "platform": platform.platform(),
                 "verl_platform": os.environ.get("VERL_PLATFORM", "auto")},
        "git": git_state(),
        "verl_wheel": _verl_pin(),
        "packages": versions(),
        "seeds": {
            "data.seed": cfg["data"].get("seed"),
            "data.shuffle": cfg["data"].get("shuffle"),
            "actor_rollout_ref.rollout.seed": cfg["actor_rollout_ref"]["rollout"].get("seed"),
        },
        "config": cfg,
    }


def write(run_dir: Path, config: DictConfig) -> Path:
    path = run_dir / "manifest.json"
    rotate(path)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(build(config), indent=1, default=str))
    tmp.replace(path)
    return path


def summary(run_dir: Path) -> str:
    latest = run_dir / "latest_checkpointed_iteration.txt"
    step = latest.read_text().strip() if latest.exists() else "none"
    metrics = run_dir / "metrics.jsonl"
    last = None
    if metrics.exists():
        lines = metrics.read_text().splitlines()
        last = json.loads(lines[-1])["step"] if lines else None
    return f"last logged step {last}, latest checkpoint global_step_{step}, folder {run_dir}"
