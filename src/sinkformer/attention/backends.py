"""Which engine serves an attention call: a registry of engines whose capabilities are data.

Each engine is one :class:`Engine` record — its name, what it serves (the capability fields), the
sentence ``"auto"`` gives when it picks it, and the function that runs a validated call — added by
:func:`register`. The built-in engines register in :mod:`.engines`; a new engine is one module that
defines its ``run`` and one ``register(Engine(...))`` line (``tests/attention/test_engine_registry.py``
adds one).

* :func:`reasons` lists *every* reason an engine cannot serve a call, read off its capabilities
  (one generic function, no engine names in it);
* :func:`choose` is ``"auto"``: the registry in priority order, the first engine that prefers the
  call and can serve it; or a forced engine, refused with all its reasons;
* :func:`engine_table` renders the capabilities as the Markdown tables of ``docs/api.md`` and
  ``docs/architecture.md`` (a test holds the pages equal to it);
* :func:`sinkformer.attention.explain` shows the choice for a call, with the reasons of every
  engine passed over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from ..sinkhorn.problem import Problem, flatten

__all__ = [
    "BACKENDS", "ENGINES", "Engine", "Call", "Prepared", "Choice", "register", "unregister", "engine",
    "reasons", "choose", "causal_cost", "engine_table",
]

#: Normalisations computed from the materialised scores entry by entry (no normalisation at all).
POINTWISE = ("linear", "sigmoid", "relu")


@dataclass(frozen=True)
class Call:
    """The scalar options of a validated call: what the choice and the engines read (no tensors)."""

    normalization: str
    n_iters: int | None
    tol: float | None
    n_q: int
    n_k: int
    return_weights: bool = False
    measure_weights: bool = False
    bias_requires_grad: bool = False
    dropout_p: float = 0.0
    backward: str = "unrolled"
    chunk_size: int | None = None
    causal: bool = False
    device: str = "cpu"
    #: what the flash kernels compile for: the dtype of q, its last dimension as the kernels see it
    #: (L2 cost: one more) and the value dimension; ``None`` where unknown (not checked then)
    dtype: torch.dtype | None = None
    head_dim: int | None = None
    value_dim: int | None = None
    max_iters: int = 1000
    #: ``"dot"``, or ``"l2"`` for the pointwise normalisations (SoftMax and Sinkhorn run L2 as a dot
    #: product on augmented vectors, so they always see ``"dot"``)
    cost: str = "dot"

    @property
    def softmax(self) -> bool:
        """SoftMax exactly: ``"softmax"``, or Sinkhorn with one normalisation."""
        return self.normalization == "softmax" or (
            self.normalization == "sinkhorn" and self.tol is None and self.n_iters == 1
        )

    @property
    def iterations(self) -> bool:
        """Sinkhorn with a column normalisation: ``n_iters >= 2`` or ``tol=``."""
        return self.normalization == "sinkhorn" and not self.softmax

    @property
    def scores(self) -> int:
        """Scores of one slice, ``n_q * n_k``."""
        return self.n_q * self.n_k


@dataclass
class Prepared:
    """A validated call, as every engine receives it: the operands in compute precision (``(*batch,
    n, d)``; L2 costs of SoftMax/Sinkhorn already augmented into dot products), the masks combined into
    ``keep`` (bool, True = take part) and ``bias`` (float), the measure weights normalised, the scalar
    options (``call``) and the chosen engine."""

    q: Tensor
    k: Tensor
    v: Tensor
    batch: tuple[int, ...]
    keep: Tensor | None
    bias: Tensor | None
    wk: Tensor | None
    wq: Tensor | None
    scale: float
    call: Call
    out_dtype: torch.dtype
    choice: Choice
    key_padding_mask: Tensor | None = None
    #: the causal mask is the only one: SDPA's own ``is_causal`` (no ``n_q x n_k`` mask formed)
    sdpa_is_causal: bool = False

    def problem(self) -> Problem:
        """The call as the Sinkhorn engines receive it: a :class:`~sinkformer.sinkhorn.problem.Problem`,
        the operands flat over the batch ``(B, n, d)``, the masks as they are, the schedule."""
        n_q, n_k, call = self.q.shape[-2], self.k.shape[-2], self.call
        return Problem(flatten(self.q, self.batch, n_q), flatten(self.k, self.batch, n_k),
                       flatten(self.v, self.batch, n_k), self.keep, self.bias, self.batch, self.scale, call.n_iters,
                       call.tol, call.max_iters)


@dataclass(frozen=True)
class Choice:
    """The engine that serves a call, why, and why each engine before it in the registry did not."""

    engine: str
    reason: str
    #: engine -> every reason it cannot serve the call (the engines ``"auto"`` passed over)
    passed_over: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        return f"{self.engine}: {self.reason}"


@dataclass(frozen=True)
class Engine:
    """An attention engine: what it serves, as data, and how it runs.

    Capabilities (``True`` = served). A call that needs one the engine lacks is refused with a
    sentence naming the argument; :func:`reasons` reads them and nothing else, except ``limits``.
    """

    name: str
    #: one line for the engine tables: what it computes and how
    summary: str
    #: memory of the engine, for the tables
    memory: str
    #: ``run(prepared) -> out`` (or ``(out, weights)`` with ``return_weights``): ``(*batch, n_q, d_v)``
    #: in ``prepared.out_dtype``; never called on empty shapes
    run: Callable[[Prepared], Tensor | tuple[Tensor, Tensor]] = field(repr=False)
    #: ``normalization=`` values it computes (``"sinkhorn"`` with one normalisation is SoftMax)
    normalizations: tuple[str, ...] = ("sinkhorn",)
    #: Sinkhorn with a column normalisation (``n_iters >= 2`` or ``tol``); False: SoftMax only
    iterations: bool = True
    #: ``tol=`` (iterate to a column error)
    tol: bool = True
    #: ``"mask"``: ``is_causal=True`` served for SoftMax only (a mask); ``"prefix"``: causal Sinkhorn
    #: only (every prefix balanced on its own, :mod:`sinkformer.sinkhorn.prefix`)
    causal: str = "mask"
    #: ``backward="implicit"`` for Sinkhorn iterations
    implicit_backward: bool = False
    #: ``return_weights=True``
    return_weights: bool = False
    #: ``key_weights=`` / ``query_weights=``
    measure_weights: bool = False
    #: ``dropout_p > 0``
    dropout: bool = False
    #: a float ``attn_mask`` that requires grad
    learned_bias: bool = False
    #: ``chunk_size=`` (query rows per block)
    chunk_size: bool = False
    #: devices it runs on; ``None``: any device PyTorch runs on
    devices: tuple[str, ...] | None = None
    #: second derivatives (``create_graph=True``), and how
    double_backward: str = "exact (autograd)"
    #: takes half-precision operands as given (its kernels accumulate in float32): no float32 copies
    half_operands: bool = False
    #: ``prefers(call) -> sentence | None``: when ``"auto"`` picks this engine (if it can serve the call), and why
    prefers: Callable[[Call], str | None] = field(default=lambda call: None, repr=False)
    #: ``limits(call) -> sentence | None``: a limit beyond the capabilities (a missing package, a dtype
    #: or head dimension without compiled kernels), or ``None``
    limits: Callable[[Call], str | None] | None = field(default=None, repr=False)
    #: ``cost(call) -> sentence``: what the call costs on this engine, added to the choice's reason
    cost: Callable[[Call], str] | None = field(default=None, repr=False)
    #: the module that implements it, for the tables
    module: str = ""


_REGISTRY: dict[str, Engine] = {}


def register(engine: Engine, *, before: str | None = None) -> Engine:
    """Add ``engine`` to the registry, last in ``"auto"``'s priority order or just before the engine
    named ``before``; returns it. A name already registered raises ``ValueError``."""
    if engine.name in _REGISTRY or engine.name == "auto":
        raise ValueError(f"engine name {engine.name!r} is already taken; registered: {', '.join(_REGISTRY)}")
    if before is not None and before not in _REGISTRY:
        raise ValueError(f"before must name a registered engine ({', '.join(_REGISTRY)}), got {before!r}")
    items = list(_REGISTRY.items())
    at = len(items) if before is None else [name for name, _ in items].index(before)
    items.insert(at, (engine.name, engine))
    _REGISTRY.clear()
    _REGISTRY.update(items)
    return engine


def unregister(name: str) -> Engine:
    """Remove the engine ``name`` from the registry (returns it)."""
    if name not in _REGISTRY:
        raise ValueError(f"no engine named {name!r}; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY.pop(name)


def engine(name: str) -> Engine:
    """The registered engine ``name``."""
    return _REGISTRY[name]


def engines() -> tuple[Engine, ...]:
    """The registered engines, in ``"auto"``'s priority order."""
    return tuple(_REGISTRY.values())


def __getattr__(name: str):
    # ENGINES and BACKENDS follow the registry (an engine registered later is listed too)
    if name == "ENGINES":
        return tuple(_REGISTRY)
    if name == "BACKENDS":
        return ("auto",) + tuple(_REGISTRY)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def reasons(engine: Engine, call: Call) -> tuple[str, ...]:
    """Every reason ``engine`` cannot serve ``call`` (sentences naming the argument); ``()`` if it can."""
    e, name, found = engine, repr(engine.name), []
    if call.normalization not in e.normalizations:
        computes = ("SoftMax" if not e.iterations else "Sinkhorn attention" if e.normalizations == ("sinkhorn",)
                    else "normalization " + " or ".join(repr(x) for x in e.normalizations))
        others = sorted(repr(x.name) for x in _REGISTRY.values() if call.normalization in x.normalizations)
        found.append(f"engine {name} computes {computes}, got normalization={call.normalization!r}"
                     + (f" (engines that compute it: {', '.join(others)})" if others else ""))
    elif call.iterations and not e.iterations:
        what = f"n_iters={call.n_iters}" if call.tol is None else f"tol={call.tol}"
        found.append(f"engine {name} computes SoftMax only (normalization='softmax' or n_iters=1), got "
                     f"normalization='sinkhorn' with {what}")
    if e.causal == "prefix":
        if not call.causal:
            found.append(f"engine {name} serves is_causal=True only (each prefix balanced on its own); pass is_causal=True")
        elif not call.iterations and call.normalization in e.normalizations:
            found.append(f"engine {name} computes causal Sinkhorn attention with n_iters >= 2, got "
                         f"normalization={call.normalization!r} with n_iters={call.n_iters}")
    elif call.causal and call.iterations:
        found.append(_refusal(f"is_causal=True with Sinkhorn attention (n_iters={call.n_iters})", name,
                              _having("causal", call, value="prefix"), "each prefix balanced on its own"))
    for capability, (needs, what, otherwise) in _NEEDS.items():
        if needs(call) and not getattr(e, capability):
            found.append(_refusal(what(call), name, _having(capability, call), otherwise))
    if e.devices is not None and call.device not in e.devices:
        found.append(f"engine {name} runs on {' or '.join(e.devices)} tensors, got device {call.device!r}")
    if e.limits is not None and (limit := e.limits(call)) is not None:
        found.append(limit)
    return tuple(found)


#: capability -> (whether a call needs it, what the call asks for in its own words, what else the user can do)
_NEEDS: dict[str, tuple[Callable[[Call], bool], Callable[[Call], str], str]] = {
    "tol": (lambda c: c.tol is not None and c.iterations, lambda c: f"tol={c.tol}", "or pass a fixed n_iters"),
    "implicit_backward": (lambda c: c.backward == "implicit" and c.iterations, lambda c: "backward='implicit'",
                          "or use backward='unrolled'"),
    "return_weights": (lambda c: c.return_weights, lambda c: "return_weights=True (the n_q x n_k weights)", ""),
    "measure_weights": (lambda c: c.measure_weights, lambda c: "key_weights/query_weights", ""),
    "dropout": (lambda c: c.dropout_p > 0, lambda c: f"dropout_p={c.dropout_p}", ""),
    "learned_bias": (lambda c: c.bias_requires_grad, lambda c: "a float attn_mask that requires grad (a learned bias)",
                     "or detach the mask"),
    "chunk_size": (lambda c: c.chunk_size is not None, lambda c: f"chunk_size={c.chunk_size}",
                   "or leave chunk_size=None"),
}


def _refusal(what: str, name: str, others: list[str], otherwise: str = "") -> str:
    """``"dropout_p=0.1 is not served by engine 'streamed'; engines 'dense' and 'tiled' serve it"``."""
    if not others:
        where = "no registered engine serves it together with this call's other options"
    else:
        listed = others[0] if len(others) == 1 else f"{', '.join(others[:-1])} and {others[-1]}"
        where = f"engine{'s' if len(others) > 1 else ''} {listed} serve{'' if len(others) > 1 else 's'} it"
    return f"{what} is not served by engine {name}; {where}" + (f"; {otherwise}" if otherwise else "")


def _having(capability: str, call: Call, value=True) -> list[str]:
    """``["'flash'", "'tiled'"]``: the registered engines, sorted, whose ``capability`` is ``value``
    among those that compute the call's attention (its normalisation, causal or not)."""
    def computes(e: Engine) -> bool:
        return (call.normalization in e.normalizations and (e.iterations or not call.iterations)
                and (e.causal == "prefix") == (call.causal and call.iterations))

    return sorted(repr(e.name) for e in _REGISTRY.values() if getattr(e, capability) == value and computes(e))


def choose(call: Call, backend: str = "auto") -> Choice:
    """The engine for ``call``: ``"auto"`` takes the first registered engine that prefers the call and
    can serve it; a forced ``backend`` is checked. ``ValueError`` with every reason when none can."""
    if backend != "auto":
        found = reasons(_REGISTRY[backend], call)
        if found:
            raise ValueError(f"backend={backend!r} cannot serve this call: {'; '.join(found)}")
        e = _REGISTRY[backend]
        return Choice(backend, "forced by backend=" + (f"; {e.cost(call)}" if e.cost is not None else ""))
    passed_over: dict[str, tuple[str, ...]] = {}
    for e in _REGISTRY.values():
        why = e.prefers(call)
        if why is None:
            continue
        found = reasons(e, call)
        if found:
            passed_over[e.name] = found
            continue
        if e.cost is not None:
            why = f"{why}; {e.cost(call)}"
        notes = "".join(f" (not {name!r}: {'; '.join(r)})" for name, r in passed_over.items())
        return Choice(e.name, why + notes, passed_over)
    listed = "\n".join(f"  {name}: {'; '.join(r)}" for name, r in passed_over.items())
    raise ValueError(f"no engine can serve this call; every engine that would take it refuses it:\n{listed}")


def causal_cost(call: Call) -> str:
    """The cost class of causal Sinkhorn with ``call.n_iters`` normalisations (:mod:`sinkformer.sinkhorn.prefix`)."""
    if call.n_iters <= 3:
        return "O(n^2) time like SoftMax (2-3 iterations with at most key padding: row blocks, never an n x n matrix)"
    return (f"n_iters={call.n_iters} >= 4 costs O(n^3) time: each normalisation beyond the third is an n x n x n "
            "matrix product per slice, with O(n^2 * n_iters) memory (n_iters <= 3 is O(n^2))")


#: capability field -> column title of the engine table
_COLUMNS = {
    "normalizations": "normalization", "iterations": "n_iters ≥ 2", "tol": "`tol`", "causal": "`is_causal`",
    "implicit_backward": "implicit backward", "return_weights": "`return_weights`",
    "measure_weights": "key/query weights", "dropout": "dropout", "learned_bias": "learned bias",
    "chunk_size": "`chunk_size`", "devices": "devices", "double_backward": "2nd derivatives",
}


def _cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "—"
    if value is None:
        return "any"
    if isinstance(value, tuple):
        return ", ".join(value)
    return {"mask": "SoftMax (a mask)", "prefix": "causal Sinkhorn only"}.get(value, str(value))


def engine_table() -> str:
    """The registered engines as Markdown: what each computes and its memory, in ``"auto"``'s priority
    order, then one row per engine of its capabilities. Rendered into the docs; a test holds them equal."""
    lines = ["| engine | what it is | memory | module |", "|---|---|---|---|"]
    for e in _REGISTRY.values():
        lines.append(f"| `{e.name}` | {e.summary} | {e.memory} | `{e.module}` |")
    names = list(_COLUMNS)
    lines += ["", "| engine | " + " | ".join(_COLUMNS[c] for c in names) + " |", "|---" * (len(names) + 1) + "|"]
    for e in _REGISTRY.values():
        lines.append(f"| `{e.name}` | " + " | ".join(_cell(getattr(e, c)) for c in names) + " |")
    return "\n".join(lines)


assert set(_COLUMNS) <= {f.name for f in fields(Engine)}
