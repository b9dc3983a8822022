"""Keyword options of constructors and loaders: listing them and checking user-given values.

Shared by the model and dataset registries and the training configuration, so that every
option mistake gives the same kind of message: the owner, the option, the expectation, the
value given, and the valid names.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["REQUIRED", "signature_options", "check_options"]

#: Marks an option without a default value (it must be given, or come from the data).
REQUIRED = inspect.Parameter.empty


def signature_options(fn: Callable) -> dict[str, Any]:
    """``{name: default}`` of the named parameters of ``fn`` (``REQUIRED`` when there is no default)."""
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


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

    Unknown names raise ``ValueError`` listing the valid ones; values of the wrong type raise
    ``TypeError`` naming the option.
    """
    unknown = sorted(set(given) - set(options))
    if unknown:
        valid = ", ".join(f"{k}={v!r}" if v is not REQUIRED else k for k, v in options.items())
        raise ValueError(f"{owner}: unknown option(s) {', '.join(unknown)}; valid options: {valid}")
    return {key: _check_type(owner, key, value, options[key]) for key, value in given.items()}
