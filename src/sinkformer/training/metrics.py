"""Per-epoch metrics files: ``metrics.csv`` and ``metrics.jsonl``, rewritten atomically each epoch.

Both files are written from the full history (which checkpoints carry), so a resumed run ends
with exactly one row per epoch even if the interrupted run had already logged a row it could not
checkpoint.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["write_metrics"]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_metrics(out_dir: str | Path, history: list[dict[str, Any]]) -> None:
    """Write ``history`` (one dict per epoch) to ``out_dir/metrics.csv`` and ``out_dir/metrics.jsonl``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for row in history:
        keys += [k for k in row if k not in keys]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=keys)
    writer.writeheader()
    writer.writerows(history)
    _atomic_write(out_dir / "metrics.csv", buffer.getvalue())
    _atomic_write(out_dir / "metrics.jsonl", "".join(json.dumps(row) + "\n" for row in history))
