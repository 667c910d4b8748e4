"""Checkpoint receipts: `<run>/global_step_N/receipt.json`, the proof that a saved state is complete.

Schema (shared contract, see docs/training.md "Wall clock, checkpoints, resume"):
    {"step": N, "complete": true,
     "files": {relpath: {"bytes": int, "sha256_blocks": str}},   # every file of the state except the receipt
     "hf_export": "actor/huggingface",                    # relative to the state folder
     "validation": {"ok": bool|null, "checks": {...}, "error": str|null},   # ok null: not validated
     "written_at": ISO-8601 UTC}

The receipt is written last, atomically (a temporary file in the same folder, fsync, os.replace):
a state folder either has a whole receipt or none. With background saves (opd_patches/ops/finish.py)
it is written by the finishing process after the export validation and the hashing have ended;
`receipt.json.pending` marks that window.

Definitions (the one place; docs/training.md "Wall clock, checkpoints, resume" repeats them):
- *complete*: the receipt is written and matches the disk: it parses, names the folder's step and
  every file it lists exists with the recorded size (`problem` is None). A listing checks sizes only;
  a resume, and `make checkpoints VERIFY=1`, also re-hash every file against its digest (`verify`).
  Resume may start from any complete state.
- *validated*: complete and the receipt records a passed export validation (`validation.ok` is True,
  `is_validated`). Kept states (`trainer.max_actor_ckpt_to_keep`) and a run's reported result count
  validated states only.
A receipt set aside because a file's digest differed (`reject`) becomes `receipt.json.rejected`:
the state is then incomplete and `problem` names the file.

The digest, `sha256_blocks`: the sha256 of the concatenated 32-byte sha256 digests of the file's consecutive
64 MiB blocks (the last one shorter; an empty file has no block). Its blocks hash side by side on every core
(hashlib releases the GIL), where one sha256 of a file runs on one: at 1.5 B the optimizer state alone is 14 GB,
and a single sha256 of it bounded the last save (docs/performance.md). Receipts written before it hold a plain
`sha256` per file, which `verify` still checks. To check a file by hand:
    python -m opd_patches.ops.receipts FILE
"""

import datetime as _dt
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NAME = "receipt.json"
PENDING = NAME + ".pending"  # written when a background finish starts (pid, started_at)
REJECTED = NAME + ".rejected"  # a receipt whose files did not match their digests (reject)
HF_EXPORT = "actor/huggingface"
_CHUNK = 1 << 22
# Markers of the background state writes (state_writer.py leaves them next to each file it writes; the
# finish waits until none is left). Here, not there: the finish process then never imports torch.
WRITING, FAILED, PARTIAL = ".writing", ".write-failed", ".partial"
DIGEST, BLOCK = "sha256_blocks", 64 << 20


def sha256(path: Path) -> str:
    """The plain sha256 of a file (receipts written before `sha256_blocks`)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def state_files(state_dir: Path, under: str | None = None, outside: str | None = None) -> list[str]:
    """Relpaths of every file under a state folder except the receipt (only those `under` a subfolder, or
    `outside` it), sorted."""
    state_dir = Path(state_dir)
    rels = []
    for p in sorted(state_dir.rglob("*")):
        rel = p.relative_to(state_dir).as_posix()
        if not p.is_file() or rel == NAME or rel.startswith(NAME + "."):
            continue
        if under is not None and not rel.startswith(under.rstrip("/") + "/"):
            continue
        if outside is not None and rel.startswith(outside.rstrip("/") + "/"):
            continue
        rels.append(rel)
    return rels


def _combine(block_digests) -> str:
    return hashlib.sha256(b"".join(block_digests)).hexdigest()


def _block(path: Path, index: int) -> bytes:
    with open(path, "rb") as f:
        return hashlib.sha256(os.pread(f.fileno(), BLOCK, index * BLOCK)).digest()


def hash_files(state_dir: Path, rels: list[str], workers: int | None = None) -> dict:
    """{relpath: {"bytes", "sha256_blocks"}} of the given files: every block of every file hashed by one pool of
    threads (a 1.5 B state's 21.3 GB from the page cache: many times faster than one thread, docs/performance.md)."""
    state_dir = Path(state_dir)
    sizes = {rel: (state_dir / rel).stat().st_size for rel in rels}
    workers = workers or max(1, min(16, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="sha256") as pool:
        futures = {rel: [pool.submit(_block, state_dir / rel, i) for i in range(-(-size // BLOCK))]
                   for rel, size in sizes.items()}
        return {rel: {"bytes": sizes[rel], DIGEST: _combine(f.result() for f in futures[rel])} for rel in rels}


def inventory(state_dir: Path) -> dict:
    """{relpath: {"bytes", "sha256_blocks"}} for every file under a state folder except the receipt."""
    return hash_files(state_dir, state_files(state_dir))


def atomic_write_json(path: Path, data: dict) -> None:
    """Write JSON so that `path` is either its old content or the whole new one, never a part.

    On any error (e.g. OSError ENOSPC) the temporary file is removed and the error re-raised;
    an existing file at `path` is left untouched.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(data, indent=1, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write(state_dir: Path, step: int, validation: dict | None, files: dict | None = None) -> dict:
    """Inventory the state folder (unless `files` is given) and write its receipt last, atomically."""
    state_dir = Path(state_dir)
    receipt = {
        "step": int(step),
        "complete": True,
        "files": inventory(state_dir) if files is None else files,
        "hf_export": HF_EXPORT,
        "validation": validation or {"ok": None, "checks": {}, "error": "not validated"},
        "written_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    atomic_write_json(state_dir / NAME, receipt)
    return receipt


def problem(state_dir: Path, step: int | None = None) -> str | None:
    """Why the state folder's receipt does not prove completeness; None when it does."""
    path = Path(state_dir) / NAME
    if not path.exists():
        return _absent_why(Path(state_dir))
    try:
        receipt = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"receipt unreadable: {exc}"
    if not isinstance(receipt, dict) or receipt.get("complete") is not True or not isinstance(receipt.get("files"), dict):
        return "receipt malformed (complete/files)"
    if step is not None and receipt.get("step") != step:
        return f"receipt names step {receipt.get('step')}, folder is step {step}"
    for rel, meta in receipt["files"].items():
        p = Path(state_dir) / rel
        if not p.is_file():
            return f"file listed in receipt missing: {rel}"
        if not isinstance(meta, dict) or p.stat().st_size != meta.get("bytes"):
            return f"file size differs from receipt: {rel}"
    return None


def _absent_why(state_dir: Path) -> str:
    """Why there is no receipt: set aside by a resume, a background finish never ended, or plain absent."""
    for name in (REJECTED, PENDING):
        try:
            info = json.loads((state_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if name == REJECTED:
            return f"receipt rejected: {info.get('rejected')}"
        return f"no receipt: background finish in progress or interrupted (pid {info.get('pid')}, started {info.get('started_at')})"
    return "no receipt"


def is_validated(receipt: dict | None) -> bool:
    """Validated = complete (a receipt `read` returned) and its export validation passed."""
    return receipt is not None and (receipt.get("validation") or {}).get("ok") is True


def read(state_dir: Path, step: int | None = None) -> dict | None:
    """The receipt when it proves the state complete, else None."""
    if problem(state_dir, step) is not None:
        return None
    return json.loads((Path(state_dir) / NAME).read_text())


def verify(state_dir: Path) -> list[str]:
    """Re-hash every file listed in the receipt; the relpaths whose digest differs (reads everything)."""
    receipt = read(state_dir)
    if receipt is None:
        return ["<no valid receipt>"]
    files = receipt["files"]
    blocks = [rel for rel, meta in files.items() if DIGEST in meta]
    now = hash_files(Path(state_dir), blocks)
    return [rel for rel, meta in files.items()
            if (now[rel][DIGEST] if rel in now else sha256(Path(state_dir) / rel)) != meta.get(DIGEST, meta.get("sha256"))]


def reject(state_dir: Path, reason: str) -> None:
    """Set a receipt aside (`receipt.json.rejected`, with the reason): the state becomes incomplete."""
    state_dir = Path(state_dir)
    try:
        old = json.loads((state_dir / NAME).read_text())
    except (OSError, ValueError):
        old = {}
    atomic_write_json(state_dir / REJECTED, {**(old if isinstance(old, dict) else {}), "rejected": reason})
    (state_dir / NAME).unlink(missing_ok=True)


def wait_for_writes(state: Path, timeout_s: float, poll_s: float = 0.2, pattern: str = "*") -> None:
    """Block until no file of `state` (matching `pattern`, an rglob pattern) is still being written; raise if
    one failed or the wait times out."""
    state = Path(state)
    deadline = time.monotonic() + timeout_s
    while True:
        failed = sorted(state.rglob(pattern + FAILED))
        if failed:
            f = failed[0]
            raise OSError(f"writing {f.relative_to(state).as_posix()[:-len(FAILED)]} of {state} failed "
                          f"({f.read_text().strip()}); the state stays incomplete")
        if not any(state.rglob(pattern + WRITING)):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the state files of {state} were still being written after {timeout_s:g} s")
        time.sleep(poll_s)


if __name__ == "__main__":  # the `sha256_blocks` of each file named
    for name in sys.argv[1:]:
        print(hash_files(Path(name).parent, [Path(name).name])[Path(name).name][DIGEST], name)
