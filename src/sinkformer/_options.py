"""Keyword options of constructors and loaders: listing them and checking user-given values.

Shared by the model and dataset registries and the training configuration, so that every
option mistake gives the same kind of message: the owner, the option, the expectation, the
value given, and the valid names.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["REQUIRED", "signature_options", "check_options", "close_matches", "did_you_mean"]

#: Marks an option without a default value (it must be given, or come from the data).
REQUIRED = inspect.Parameter.empty


def signature_options(fn: Callable) -> dict[str, Any]:
    """``{name: default}`` of the named parameters of ``fn`` (``REQUIRED`` when there is no default)."""
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def _fold(name: str) -> str:
    """How names are compared for suggestions: case, ``-`` vs ``_`` and surrounding spaces ignored."""
    return str(name).strip().lower().replace("-", "_")


def close_matches(name: str, valid: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """The (at most ``n``) names of ``valid`` closest to ``name``, best first: :func:`difflib.get_close_matches`
    on names folded to lower case with ``-`` read as ``_`` (``ViT`` finds ``vit``, ``patch_size`` ``patch-size``)."""
    folded: dict[str, str] = {}
    for v in valid:
        folded.setdefault(_fold(v), v)
    return [folded[m] for m in difflib.get_close_matches(_fold(name), list(folded), n=n, cutoff=cutoff)]


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """``"did you mean 'modelnet'? "`` (or ``'a' or 'b'``, ``'a', 'b' or 'c'``) for the close matches of
    ``name`` among ``valid``; ``""`` when none is close. Made to sit between the error and the list of
    valid names: ``f"unknown experiment {name!r}; {did_you_mean(name, names)}valid names: ..."``."""
    matches = [repr(m) for m in close_matches(name, valid)]
    if not matches:
        return ""
    listed = matches[0] if len(matches) == 1 else f"{', '.join(matches[:-1])} or {matches[-1]}"
    return f"did you mean {listed}? "


def _yaml_float(value: Any) -> Any:
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; take it as the float it means."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _check_type(owner: str, key: str, value: Any, default: Any) -> Any:
    """``value`` converted to the type of ``default`` (int -> float, list <-> tuple), or a ``TypeError``."""
    if default is None or default is REQUIRED:
        return value
    expected: tuple[type, ...]
    if isinstance(default, bool):
        ok, expected = isinstance(value, bool), (bool,)
    elif isinstance(default, int):
        ok, expected = isinstance(value, int) and not isinstance(value, bool), (int,)
    elif isinstance(default, float):
        value = _yaml_float(value)
        ok, expected = isinstance(value, (int, float)) and not isinstance(value, bool), (float,)
        value = float(value) if ok else value
    elif isinstance(default, (list, tuple)):
        ok, expected = isinstance(value, (list, tuple)), (list,)
        value = type(default)(value) if ok else value
    else:
        ok, expected = isinstance(value, type(default)), (type(default),)
    if not ok:
        names = " or ".join(t.__name__ for t in expected)
        raise TypeError(
            f"{owner}: option {key} must be {names} (default {default!r}), got {type(value).__name__} {value!r}"
        )
    return value


def check_options(owner: str, given: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """Check ``given`` against the ``options`` (name -> default) of ``owner``; returns converted values.

    Unknown names raise ``ValueError`` suggesting the closest valid names and listing them all; values
    of the wrong type raise ``TypeError`` naming the option.
    """
    unknown = sorted(set(given) - set(options))
    if unknown:
        valid = ", ".join(f"{k}={v!r}" if v is not REQUIRED else k for k, v in options.items())
        if len(unknown) == 1:
            hints = did_you_mean(unknown[0], options)
        else:
            hints = "".join(f"{k}: {hint}" for k in unknown if (hint := did_you_mean(k, options)))
        raise ValueError(f"{owner}: unknown option(s) {', '.join(unknown)}; {hints}valid options: {valid}")
    return {key: _check_type(owner, key, value, options[key]) for key, value in given.items()}
