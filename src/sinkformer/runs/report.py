"""Writing what runs produce: markdown tables, self-contained HTML pages, run folders, atomic files."""

from __future__ import annotations

import base64
import datetime as _dt
import html
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._optional import require

__all__ = ["markdown_table", "format_number", "render_html", "new_run_dir", "atomic_write"]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; ``None`` and NaN become a dash, floats go through :func:`format_number`."""

    def cell(x: Any) -> str:
        if x is None or (isinstance(x, float) and math.isnan(x)):
            return "—"
        return format_number(x) if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def format_number(x: float) -> str:
    """A float for a report: 4 decimals below 1, 3 below 10, 2 below 10^4, else 4 significant
    digits; magnitudes below 1e-3 (and infinities) in scientific notation."""
    a = abs(x)
    if a == 0:
        return "0"
    if a < 1e-3 or not math.isfinite(x):
        return f"{x:.3g}"
    if a < 1:
        return f"{x:.4f}"
    if a < 10:
        return f"{x:.3f}"
    return f"{x:.2f}" if a < 1e4 else f"{x:.4g}"


_HTML_STYLE = """body{font-family:system-ui,sans-serif;max-width:62rem;margin:2rem auto;padding:0 1rem;line-height:1.45}
img{max-width:100%}table{border-collapse:collapse;margin:.8rem 0}th,td{border:1px solid #ccc;padding:.25rem .6rem}
th{background:#f3f3f3}pre{background:#f6f6f6;padding:.6rem;overflow-x:auto}code{font-size:90%}"""


def render_html(markdown_text: str, base_dir: str | os.PathLike, title: str) -> str:
    """``markdown_text`` as one self-contained HTML page: PNGs referenced by a path relative to
    ``base_dir`` are embedded as base64 data, so the page can be mailed or opened anywhere; a relative
    link to a markdown page (``NAME/report.md``) points to its HTML page instead when that exists."""
    markdown = require("markdown", "HTML reports")  # imported lazily: listing experiments stays fast

    def embed(match: re.Match) -> str:
        path = Path(base_dir) / html.unescape(match.group(2))
        if path.suffix.lower() != ".png" or not path.is_file():
            return match.group(0)
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        return f"{match.group(1)}data:image/png;base64,{data}{match.group(3)}"

    def to_html(match: re.Match) -> str:
        target, fragment = match.group(2), match.group(3) or ""
        page = Path(base_dir) / html.unescape(target[: -len(".md")] + ".html")
        return f"{match.group(1)}{target[: -len('.md')]}.html{fragment}\"" if page.is_file() else match.group(0)

    body = markdown.markdown(markdown_text, extensions=["tables", "fenced_code"])
    body = re.sub(r'(<img\b[^>]*?\bsrc=")([^"]+)(")', embed, body)
    body = re.sub(r'(<a\b[^>]*?\bhref=")(?![a-z][a-z0-9+.-]*:|/|#)([^"#]+\.md)(#[^"]*)?"', to_html, body)
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_HTML_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n")


def new_run_dir(parent: Path) -> Path:
    """A new folder ``parent/<timestamp>`` (``-2``, ``-3``, ... appended if it exists)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir, suffix = parent / stamp, 1
    while out_dir.exists():
        suffix += 1
        out_dir = parent / f"{stamp}-{suffix}"
    out_dir.mkdir(parents=True)
    return out_dir


def atomic_write(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path
