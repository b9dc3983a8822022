"""From a configuration to a trained model — what ``sinkformer train`` runs.

A configuration has three sections (YAML or TOML files; ``configs/`` holds the paper's)::

    model: {name: set_transformer, normalization: sinkhorn, n_iters: 21, dim: 256}
    data:  {name: modelnet40_off, path: ~/data/ModelNet40, n_points: 5000}
    train: {epochs: 300, batch_size: 64, lr: 1.0e-3, milestones: [200]}

``model`` options are the model constructor's keywords, ``data`` options the loader's (plus
``path``), ``train`` options those of :class:`~sinkformer.training.TrainConfig`. Command-line
flags and ``--set section.key=value`` override the file. :func:`check_config` validates every
name, option and type *before* any data is loaded, so a typo fails in a second, naming the
option.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from ..data import DATASETS, dataset_options, get_dataset, load_dataset
from ..models import MODELS, build_model, get_model_class, model_options, switched_by
from .._options import REQUIRED, check_options
from .config import TrainConfig
from .distributed import broadcast_object, setup_distributed
from .loop import Callback, TrainResult, train

__all__ = ["SECTIONS", "read_config_file", "apply_sets", "resolve_config", "Plan", "check_config", "run_training",
           "describe_options"]

SECTIONS = ("model", "data", "train")


def _merge(config: dict[str, dict], update: dict[str, Any], source: str) -> None:
    for section, values in update.items():
        values = {} if values is None else values
        if section not in SECTIONS:
            raise ValueError(f"{source}: unknown section {section!r}; valid sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ValueError(f"{source}: section {section!r} must be a mapping of options, got {values!r}")
        config[section].update(values)


def read_config_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a YAML (``.yaml``/``.yml``) or TOML (``.toml``) configuration file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--config {path}: no such file")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            raw = tomllib.loads(text)
        else:
            raw = yaml.safe_load(text) or {}
    except Exception as err:  # parse errors of either format
        raise ValueError(f"--config {path}: cannot parse: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: expected sections {', '.join(SECTIONS)} at the top level")
    config: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    _merge(config, raw, f"--config {path}")
    return config


def apply_sets(config: dict[str, dict[str, Any]], pairs: list[str]) -> None:
    """Apply ``section.key=value`` overrides (values parsed as YAML: ``1e-3``, ``[200]``, ``true``)."""
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ValueError(f"--set expects section.key=value (e.g. train.lr=1e-4), got {pair!r}")
        _merge(config, {section: {name: yaml.safe_load(raw)}}, f"--set {pair}")


def resolve_config(
    file: str | Path | None = None,
    *,
    model: str | None = None,
    data: str | None = None,
    data_path: str | None = None,
    normalization: str | None = None,
    n_iters: int | None = None,
    sets: list[str] = (),
) -> dict[str, dict[str, Any]]:
    """The configuration from a file, then the named flags, then ``--set`` pairs (later wins)."""
    config = read_config_file(file) if file is not None else {s: {} for s in SECTIONS}
    flags = {"model": {"name": model, "normalization": normalization, "n_iters": n_iters},
             "data": {"name": data, "path": data_path}}
    _merge(config, {s: {k: v for k, v in values.items() if v is not None} for s, values in flags.items()}, "flags")
    apply_sets(config, list(sets))
    return config


@dataclass
class Plan:
    """A checked configuration, ready to run."""

    model: str
    data: str
    data_path: str | None
    train: TrainConfig
    model_options: dict[str, Any] = field(default_factory=dict)
    data_options: dict[str, Any] = field(default_factory=dict)


def check_config(config: dict[str, dict[str, Any]]) -> Plan:
    """Validate names, options and types of a configuration without loading anything."""
    model_cfg, data_cfg = dict(config.get("model", {})), dict(config.get("data", {}))
    model_name, data_name = model_cfg.pop("name", None), data_cfg.pop("name", None)
    if model_name is None:
        raise ValueError(f"no model given: use --model NAME (or model.name); valid models: {', '.join(MODELS)}")
    if data_name is None:
        raise ValueError(f"no dataset given: use --data NAME (or data.name); valid datasets: {', '.join(DATASETS)}")
    cls, spec = get_model_class(model_name), get_dataset(data_name)
    if cls.input_kind != spec.kind:
        compatible = [name for name, s in DATASETS.items() if s.kind == cls.input_kind]
        raise ValueError(
            f"model {model_name!r} reads {cls.input_kind} but dataset {data_name!r} gives {spec.kind}; "
            f"datasets for {model_name!r}: {', '.join(compatible)}"
        )
    if switched_by(model_name) == "attention" and ({"normalization", "n_iters"} & set(model_cfg)):
        raise ValueError(
            f"model {model_name!r} is a Sparse Sinkhorn Attention model, switched by model.attention "
            f"(e.g. --set model.attention=sinkhorn:16, vanilla, sortcut:2x8), not by --normalization / --n-iters"
        )
    model_opts = check_options(f"model {model_name!r}", model_cfg, model_options(model_name))
    path = data_cfg.pop("path", None)
    if spec.embedded and path is not None:
        raise ValueError(f"dataset {data_name!r} is embedded and takes no path (data.path / --data-path), got {path}")
    data_opts = check_options(f"dataset {data_name!r}", data_cfg, dataset_options(data_name))
    return Plan(model_name, data_name, path, TrainConfig.from_dict(config.get("train", {})), model_opts, data_opts)


def _default_out_dir(plan: Plan) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    switch = switched_by(plan.model)
    norm = plan.model_options.get(switch, model_options(plan.model)[switch]) or "sinkhorn"
    norm = str(norm).replace(":", "")
    return Path("runs") / "train" / f"{plan.model}-{norm}-{plan.data}-{stamp}"


def run_training(
    config: dict[str, dict[str, Any]],
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    callbacks: list[Callback] = (),
) -> TrainResult:
    """Check ``config``, load the data, build the model (seeded) and :func:`~sinkformer.training.train` it.

    ``out_dir`` defaults to ``runs/train/<model>-<normalization>-<data>-<timestamp>/``; it gets
    ``config.yaml`` (the resolved configuration) besides what :func:`train` writes.
    """
    plan = check_config(config)
    ctx = setup_distributed(plan.train.device)
    out_dir = Path(broadcast_object(str(out_dir or _default_out_dir(plan)), ctx))
    data = load_dataset(plan.data, plan.data_path, **plan.data_options)
    torch.manual_seed(plan.train.seed)
    model = build_model(plan.model, data.info, **plan.model_options)
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        resolved = {"model": {"name": plan.model, **plan.model_options},
                    "data": {"name": plan.data, **({"path": plan.data_path} if plan.data_path else {}),
                             **{k: list(v) if isinstance(v, tuple) else v for k, v in plan.data_options.items()}},
                    "train": plan.train.to_dict()}
        (out_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{plan.model} ({n_params:,} parameters) on {plan.data} ({len(data.train)} train / {len(data.test)} "
              f"test), {ctx.world_size} process(es) on {ctx.device}; writing {out_dir}")
    return train(model, data, plan.train, out_dir=out_dir, resume=resume, callbacks=callbacks)


def _format_options(options: dict[str, Any]) -> str:
    return ", ".join(name if default is REQUIRED else f"{name}={default!r}" for name, default in options.items())


def describe_options() -> str:
    """Every model, dataset and train option with its default (for ``sinkformer train --help``)."""
    lines = ["models (--model NAME; options: --set model.KEY=VALUE; sizes without default come from the data):"]
    lines += [f"  {name} [{cls.input_kind}]: {_format_options(model_options(name))}" for name, cls in MODELS.items()]
    lines.append("datasets (--data NAME; options: --set data.KEY=VALUE; real ones need --data-path):")
    for name, spec in DATASETS.items():
        where = "embedded" if spec.embedded else "needs --data-path"
        lines.append(f"  {name} [{spec.kind}, {where}]: {_format_options(dataset_options(name)) or '-'}")
    lines.append("train options (--set train.KEY=VALUE):")
    lines.append("  " + _format_options({k: (list(v) if isinstance(v, tuple) else v)
                                         for k, v in TrainConfig().to_dict().items()}))
    return "\n".join(lines)
