"""Source files of `make data` and `make data-eval` (.parquet, .jsonl or .json) read into rows."""

from __future__ import annotations

import json
from pathlib import Path


def must_exist(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"source {path} does not exist (SRC= takes .parquet, .jsonl or .json files)")


def read_rows(path: Path) -> list[dict]:
    import pandas as pd
    import pyarrow as pa

    from opd_patches.checks import InputError

    must_exist(path)
    if path.suffix == ".parquet":
        try:
            return pd.read_parquet(path).to_dict("records")
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"source {path}: not a readable parquet file ({str(exc).splitlines()[0]}); "
                             "a .jsonl or .json source is read as such") from None
    if path.suffix == ".jsonl":
        rows = []
        for i, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise InputError(f"source {path}:{i + 1}: not a JSON object ({exc})") from None
        return rows
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise InputError(f"source {path}: not valid JSON ({exc})") from None
        return data if isinstance(data, list) else data["data"]
    raise ValueError(f"source {path}: unknown format {path.suffix!r} (use .parquet, .jsonl or .json)")
