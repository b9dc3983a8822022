"""From a configuration to a trained model — what ``sinkformer train`` runs.

A configuration has three sections (YAML or TOML files; :mod:`sinkformer.configs` ships the paper's,
found by name: ``--config pct_modelnet40``)::

    model: {name: set_transformer, attention: sinkhorn, n_iters: 21, dim: 256}
    data:  {name: modelnet40_off, path: ~/data/ModelNet40, n_points: 5000}
    train: {epochs: 300, batch_size: 64, lr: 1.0e-3, milestones: [200]}

``model`` options are the model constructor's keywords, ``data`` options the loader's (plus
``path``), ``train`` options those of :class:`~sinkformer.training.TrainConfig`. Command-line
flags and ``--set section.key=value`` override the file. A model option that none of them sets
takes the dataset's default when :data:`DATASET_MODEL_DEFAULTS` has one (sizes that suit the data:
small models for the small embedded datasets, patches that divide the image), else the
constructor's. :func:`check_config` validates every name, option and type *before* any data is
loaded, so a typo fails in a second, naming the option.

A run folder (``--out``) holds everything needed to use the trained model again
(:func:`sinkformer.load_run`)::

    config.yaml                 the resolved configuration (model, data and train sections)
    provenance.json             the code (sinkformer's version, its commit in a source checkout), libraries, machine
    resumes.jsonl               one line per resume: when, from which checkpoint, the options it changed, provenance
    data_info.json              the dataset's ``info`` (sizes, class names): the model is rebuilt without the data
    tokenizer.json              the ``tokenizers.Tokenizer`` of text data (text datasets only)
    metrics.csv, metrics.jsonl  one row per epoch
    checkpoints/epoch_NNNN/     model.safetensors + state.pt (optimiser, RNG, progress), the newest kept
    model.safetensors           the final weights (written when training ends)
    attention/epoch_NNNN.safetensors   attention column sums (train.record_attention only)

:func:`prepare_run_folder` guards it: a folder that already holds a run is refused unless the
run is resumed (``resume=True``, ``--resume``) or replaced (``overwrite=True``, ``--overwrite``).
Replacing deletes only the entries above (and the temporary files of their atomic writes);
any other file in the folder is kept and listed. A path that cannot be a folder, or a folder
that cannot be written, fails before any data is loaded.

A resumed run continues with the options it started with (its ``config.yaml``): a resume whose
model, data or optimisation options differ is refused, listing the differences
(:func:`~sinkformer.training.config.resume_changes`); options that only change how the run goes on
from here (:data:`~sinkformer.training.config.SCHEDULE_OPTIONS`: more epochs, evaluation and
checkpoint intervals, the device, ...) need ``allow_schedule_changes=True``
(``--allow-schedule-changes``) and are recorded in ``resumes.jsonl``. A run that stops before its
first checkpoint — an error, a model that cannot be built, Ctrl-C — leaves nothing behind: what it
wrote is deleted, and so is the folder if the run made it.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data import DATASETS, dataset_options, get_dataset, load_dataset
from ..models import MODELS, build_model, get_model_class, model_options
from ..models.attention_spec import renamed_options
from .._optional import require
from .._options import REQUIRED, check_options
from ..configs import find_config
from .checkpoint import checkpoint_problem, list_checkpoints, remove_partial_checkpoints
from .config import TrainConfig, resume_changes
from .distributed import barrier, broadcast_object, setup_distributed
from .loop import Callback, TrainResult, train

yaml = require("yaml", "configuration files")

__all__ = ["SECTIONS", "read_config_file", "apply_sets", "resolve_config", "Plan", "check_config", "run_training",
           "describe_options", "RunFolderError", "RUN_FILES", "run_entries", "prepare_run_folder",
           "DATA_INFO_FILE", "TOKENIZER_FILE", "PROVENANCE_FILE", "RESUMES_FILE", "DATASET_MODEL_DEFAULTS",
           "effective_options"]

logger = logging.getLogger(__name__)

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
    """Read a YAML (``.yaml``/``.yml``) or TOML (``.toml``) configuration file: a path, or the name of
    a configuration shipped with the package (``"pct_modelnet40"``; :mod:`sinkformer.configs`)."""
    try:
        path = find_config(path)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"--config {err}") from None
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                tomllib = require("tomli", "TOML configurations on Python < 3.11")
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
    attention: str | None = None,
    n_iters: int | None = None,
    sets: list[str] = (),
) -> dict[str, dict[str, Any]]:
    """The configuration from a file, then the named flags, then ``--set`` pairs (later wins)."""
    config = read_config_file(file) if file is not None else {s: {} for s in SECTIONS}
    flags = {"model": {"name": model, "attention": attention, "n_iters": n_iters},
             "data": {"name": data, "path": data_path}}
    _merge(config, {s: {k: v for k, v in values.items() if v is not None} for s, values in flags.items()}, "flags")
    apply_sets(config, list(sets))
    return config


#: Model options a dataset brings when neither the configuration nor the flags set them, for the
#: models that take them: sizes that suit the data. The embedded datasets are small, and so are their
#: models (an epoch takes about a second on one laptop core; the constructors' defaults are the
#: papers' sizes, for the real datasets); a ViT's patches must divide the image (digits are 8x8,
#: MNIST 28x28).
DATASET_MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {"patch_size": 2, "dim": 32, "depth": 2, "num_heads": 4, "dim_feedforward": 64},
    "mnist": {"patch_size": 7},
    "shapes3d": {"dim": 32, "num_inducing": 8, "n_samples": [64, 32], "k_neighbors": 16, "n_attention_layers": 2},
    "sentiment": {"dim": 32, "depth": 2, "num_heads": 4, "dim_feedforward": 64},
    "translation": {"dim": 32, "encoder_layers": 2, "decoder_layers": 2, "dim_feedforward": 64, "dropout": 0.1},
    "nli_generated": {"dim": 32, "depth": 2},
    "stdlib_text": {"dim": 32, "depth": 2},
}


@dataclass
class Plan:
    """A checked configuration, ready to run. ``from_dataset``: the model options that came from
    :data:`DATASET_MODEL_DEFAULTS` (the configuration did not set them)."""

    model: str
    data: str
    data_path: str | None
    train: TrainConfig
    model_options: dict[str, Any] = field(default_factory=dict)
    data_options: dict[str, Any] = field(default_factory=dict)
    from_dataset: tuple[str, ...] = ()


def check_config(config: dict[str, dict[str, Any]]) -> Plan:
    """Validate names, options and types of a configuration without loading anything."""
    model_cfg, data_cfg = dict(config.get("model", {})), dict(config.get("data", {}))
    model_name, data_name = model_cfg.pop("name", None), data_cfg.pop("name", None)
    if model_name is None:
        raise ValueError(f"no model given: use --model NAME (or model.name); valid models: {', '.join(MODELS)}")
    if data_name is None:
        raise ValueError(f"no dataset given: use --dataset NAME (or data.name); valid datasets: {', '.join(DATASETS)}")
    cls, spec = get_model_class(model_name), get_dataset(data_name)
    if cls.input_kind != spec.kind:
        compatible = [name for name, s in DATASETS.items() if s.kind == cls.input_kind]
        raise ValueError(
            f"model {model_name!r} reads {cls.input_kind} but dataset {data_name!r} gives {spec.kind}; "
            f"datasets for {model_name!r}: {', '.join(compatible)}"
        )
    model_cfg = renamed_options(model_cfg, f"model {model_name!r}")
    options = model_options(model_name)
    from_dataset = {k: v for k, v in DATASET_MODEL_DEFAULTS.get(data_name, {}).items()
                    if k in options and k not in model_cfg}
    model_opts = check_options(f"model {model_name!r}", {**from_dataset, **model_cfg}, options)
    path = data_cfg.pop("path", None)
    if spec.embedded and path is not None:
        raise ValueError(f"dataset {data_name!r} is embedded and takes no path (data.path / --data), got {path}")
    data_opts = check_options(f"dataset {data_name!r}", data_cfg, dataset_options(data_name))
    return Plan(model_name, data_name, path, TrainConfig.from_dict(config.get("train", {})), model_opts, data_opts,
                tuple(from_dataset))


def _resolved(plan: Plan) -> dict[str, dict[str, Any]]:
    """The configuration a run folder's ``config.yaml`` holds: every option the plan sets."""
    return {"model": {"name": plan.model, **plan.model_options},
            "data": {"name": plan.data, **({"path": plan.data_path} if plan.data_path else {}),
                     **{k: list(v) if isinstance(v, tuple) else v for k, v in plan.data_options.items()}},
            "train": plan.train.to_dict()}


def effective_options(plan: Plan) -> dict[str, Any]:
    """Every option of ``plan`` as it takes effect, defaults included, flat: ``{"model.dim": 32,
    "data.path": None, "train.lr": 0.001, ...}`` (sizes the data gives, without default, are left out)."""
    def plain(value: Any) -> Any:
        return list(value) if isinstance(value, tuple) else value

    flat: dict[str, Any] = {"model.name": plan.model, "data.name": plan.data, "data.path": plan.data_path}
    for section, given, defaults in (("model", plan.model_options, model_options(plan.model)),
                                     ("data", plan.data_options, dataset_options(plan.data))):
        for key, default in defaults.items():
            if key in given or default is not REQUIRED:
                flat[f"{section}.{key}"] = plain(given.get(key, default))
    flat.update({f"train.{k}": v for k, v in plan.train.to_dict().items()})
    return flat


def _default_out_dir(plan: Plan) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    spec = plan.model_options.get("attention", model_options(plan.model)["attention"]) or "sparse"
    norm = str(spec).replace(":", "")
    return Path("runs") / "train" / f"{plan.model}-{norm}-{plan.data}-{stamp}"


CONFIG_FILE, DATA_INFO_FILE, TOKENIZER_FILE = "config.yaml", "data_info.json", "tokenizer.json"
PROVENANCE_FILE, RESUMES_FILE = "provenance.json", "resumes.jsonl"
#: What a run writes at the top of its folder: files, then folders (whose own known entries are below).
RUN_FILES = (CONFIG_FILE, PROVENANCE_FILE, RESUMES_FILE, DATA_INFO_FILE, TOKENIZER_FILE, "metrics.csv", "metrics.jsonl",
             "model.safetensors")
RUN_FOLDERS = {"checkpoints": re.compile(r"^(epoch_\d+|\.tmp-epoch_\d+.*)$"),
               "attention": re.compile(r"^\.?epoch_\d+\.safetensors(\.tmp\d+)?$")}
# the temporary files of atomic writes (``.NAME.tmpPID``) of the files above
_TMP_FILE = re.compile(r"^\.(%s)\.tmp\d+$" % "|".join(re.escape(name) for name in RUN_FILES))


class RunFolderError(ValueError):
    """A run folder (``--out``) that cannot be used: one line naming the path (``sinkformer train``
    reports ValueErrors as ``sinkformer train: error: ...``, exit code 2)."""


def run_entries(out_dir: str | Path) -> list[str]:
    """The names of what a run wrote that ``out_dir`` holds (empty: no run there): the files of
    :data:`RUN_FILES`, and ``checkpoints/`` or ``attention/`` when they hold checkpoints or attention files."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [name for name in RUN_FILES if (out_dir / name).exists() or (out_dir / name).is_symlink()]
    for name, known in RUN_FOLDERS.items():
        folder = out_dir / name
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            found.append(name)
        elif folder.is_dir() and any(known.match(entry.name) for entry in folder.iterdir()):
            found.append(name)
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _remove_run(out_dir: Path) -> list[str]:
    """Delete what a run wrote in ``out_dir``; returns the names of the other entries, which are kept."""
    kept = []
    for name in RUN_FILES:
        path = out_dir / name
        if path.is_file() or path.is_symlink():
            path.unlink()
        elif path.exists():  # a folder by that name is not what a run writes
            kept.append(name)
    for name, known in RUN_FOLDERS.items():
        folder = out_dir / name
        if folder.is_symlink() or folder.is_file():
            kept.append(name)
            continue
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            if known.match(entry.name):
                _remove(entry)
            else:
                kept.append(f"{name}/{entry.name}")
        if not any(folder.iterdir()):
            folder.rmdir()
    for entry in out_dir.iterdir():
        if _TMP_FILE.match(entry.name) and entry.is_file():
            entry.unlink()
        elif entry.name not in RUN_FOLDERS and entry.name not in kept:
            kept.append(entry.name)
    return sorted(kept)


def _why_not_a_folder(out_dir: Path, err: OSError) -> str:
    for parent in (out_dir, *out_dir.parents):
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                return f"{parent} is a file, not a folder"
            break
    return err.strerror or str(err)


def prepare_run_folder(
    out_dir: str | Path, *, resume: bool = False, overwrite: bool = False
) -> tuple[list[str], list[str]]:
    """Make ``out_dir`` ready for a run; returns ``(removed, kept)``: the entries of a previous run
    that ``overwrite`` deleted, and the other entries of the folder, which it kept.

    * the folder is created (with its parents) and must be writable;
    * if it already holds a run (:func:`run_entries`: ``config.yaml``, metrics, checkpoints, weights,
      ...) it is refused unless ``resume`` (continue it) or ``overwrite`` (delete that run's files —
      only those, never other files — and start again);
    * ``resume`` with checkpoints of which none is complete is refused (the newest *complete* one is
      resumed from, see :func:`~sinkformer.training.checkpoint.latest_checkpoint`);
    * the leftovers of killed checkpoint writes (``checkpoints/.tmp-epoch_*``) are removed.

    Raises :class:`RunFolderError` (a ``ValueError``) with a one-line message naming the path.
    """
    out_dir = Path(out_dir).expanduser()
    if resume and overwrite:
        raise RunFolderError(f"--out {out_dir}: --resume continues the run there and --overwrite deletes it; "
                             f"give one of them")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunFolderError(f"--out {out_dir}: cannot create the run folder: {_why_not_a_folder(out_dir, err)}") from None
    try:
        with tempfile.TemporaryFile(dir=out_dir, prefix=".write-test-"):
            pass
    except OSError as err:
        raise RunFolderError(f"--out {out_dir}: cannot write in the run folder: {err.strerror or err}") from None
    found, removed, kept = run_entries(out_dir), [], []
    if found and not resume:
        if not overwrite:
            raise RunFolderError(
                f"--out {out_dir} already holds a run ({', '.join(found)}): use --resume (resume=True) to continue "
                f"it, --overwrite (overwrite=True) to delete it and start again, or another --out"
            )
        removed, kept = found, _remove_run(out_dir)
    remove_partial_checkpoints(out_dir / "checkpoints")
    if resume:
        checkpoints = list_checkpoints(out_dir / "checkpoints")
        problems = [checkpoint_problem(path) for path in checkpoints]
        if checkpoints and all(problems):
            raise RunFolderError(f"--out {out_dir}: cannot resume, no checkpoint is complete: {'; '.join(problems)}; "
                                 f"use --overwrite (overwrite=True) to start again")
    return removed, kept


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def _write_text(path: Path, text: str) -> None:
    """Write ``path`` atomically (a temporary file renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _write_run_files(out_dir: Path, plan: Plan, data: Any) -> None:
    """``config.yaml``, ``data_info.json`` and (text data) ``tokenizer.json``: what :func:`sinkformer.load_run` reads."""
    _write_text(out_dir / CONFIG_FILE, yaml.safe_dump(_resolved(plan), sort_keys=False))
    _write_text(out_dir / DATA_INFO_FILE, json.dumps(_json_safe(data.info), indent=1) + "\n")
    if data.tokenizer is not None:
        _write_text(out_dir / TOKENIZER_FILE, data.tokenizer.to_str())


def _newest_complete(out_dir: Path) -> Path | None:
    """The newest complete checkpoint of the run in ``out_dir`` (``None`` when there is none)."""
    return next((p for p in reversed(list_checkpoints(out_dir / "checkpoints")) if checkpoint_problem(p) is None), None)


def _epoch_of(checkpoint: Path) -> int:
    """The epoch of checkpoint folder ``epoch_NNNN``."""
    return int(checkpoint.name.split("_")[1])


def _saved_plan(out_dir: Path) -> Plan | None:
    """The plan of the run in ``out_dir`` (from its ``config.yaml``; ``None`` when it has none)."""
    path = out_dir / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return check_config(read_config_file(path))
    except (ValueError, TypeError) as err:
        raise RunFolderError(f"--out {out_dir}: cannot resume, the run's {CONFIG_FILE} is not a valid "
                             f"configuration: {err}") from None


def _check_resume(out_dir: Path, plan: Plan, allow_schedule_changes: bool) -> dict[str, list]:
    """The schedule options a resume of the run in ``out_dir`` changes (see :func:`resume_changes`);
    ``RunFolderError`` for the changes it may not make."""
    saved = _saved_plan(out_dir)
    if saved is None:
        return {}
    checkpoint = _newest_complete(out_dir)
    trained = _epoch_of(checkpoint) if checkpoint is not None else 0
    try:
        return resume_changes(effective_options(saved), effective_options(plan), trained_epochs=trained,
                              allow_schedule_changes=allow_schedule_changes, where=f"the run in {out_dir}")
    except ValueError as err:
        raise RunFolderError(f"--out {out_dir}: {err}") from None


def _record_start(out_dir: Path, resume: bool, changes: dict[str, list]) -> None:
    """``provenance.json`` for a new run; for a resume, a line of ``resumes.jsonl`` (when, from which
    checkpoint, the options it changed, its own provenance): the start's provenance stays as it was."""
    from ..provenance import provenance

    facts = provenance()
    if not resume or not (out_dir / PROVENANCE_FILE).exists():
        _write_text(out_dir / PROVENANCE_FILE, json.dumps(facts, indent=2) + "\n")
    if resume:
        checkpoint = _newest_complete(out_dir)
        line = {"date": facts["date"], "from": checkpoint.name if checkpoint else None, "changes": changes,
                "provenance": facts}
        with open(out_dir / RESUMES_FILE, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")


def _made_folders(out_dir: Path) -> list[Path]:
    """The folders that creating ``out_dir`` will make (deepest first): those of it and its parents that do not exist."""
    made = []
    for folder in (out_dir, *out_dir.parents):
        if folder.exists() or folder.is_symlink():
            break
        made.append(folder)
    return made


def _after_a_stop(out_dir: Path, continued: bool, made: list[Path]) -> str:
    """Clean up after a run that stopped (an error, Ctrl-C) and say what was kept: a new run without a
    complete checkpoint leaves nothing (its files deleted, the folders it made removed); a run with one,
    or an earlier run it ``continued``, is kept, resumable from its newest checkpoint."""
    checkpoint = _newest_complete(out_dir)
    if checkpoint is not None or continued:
        where = f"its checkpoint of epoch {_epoch_of(checkpoint)}" if checkpoint else "no checkpoint"
        return (f"kept the run in {out_dir} ({where}); continue it with: sinkformer train --resume --out {out_dir}")
    if out_dir.is_dir():
        _remove_run(out_dir)
        for folder in made:
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
    return f"nothing kept: the run stopped before its first checkpoint, and what it wrote in {out_dir} was removed"


def _build(plan: Plan, data: Any) -> torch.nn.Module:
    """The plan's model for ``data``; a constructor's refusal names the model, the data's sizes and how
    to set the option it names."""
    try:
        return build_model(plan.model, data.info, **plan.model_options)
    except (ValueError, TypeError) as err:
        sizes = ", ".join(f"{k}={v}" for k, v in data.info.items() if k in model_options(plan.model))
        named = [k for k in model_options(plan.model) if re.search(rf"\b{k}\b", str(err)) and k not in data.info]
        hint = "; set it with " + " or ".join(f"--set model.{k}=VALUE" for k in named) if named else ""
        raise ValueError(f"model {plan.model!r} cannot be built for dataset {plan.data!r}"
                         f"{f' ({sizes})' if sizes else ''}: {err}{hint}") from None


def run_training(
    config: dict[str, dict[str, Any]],
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_schedule_changes: bool = False,
    callbacks: list[Callback] = (),
) -> TrainResult:
    """Check ``config``, load the data, build the model (seeded) and :func:`~sinkformer.training.train` it.

    ``out_dir`` defaults to ``runs/train/<model>-<attention>-<data>-<timestamp>/``; it gets
    ``config.yaml`` (the resolved configuration), ``provenance.json``, ``data_info.json`` and, for
    text data, ``tokenizer.json`` besides what :func:`train` writes (see the module's docstring).
    A folder that already holds a run is refused unless ``resume`` (continue from its newest
    complete checkpoint) or ``overwrite`` (delete that run's files first): see
    :func:`prepare_run_folder`. A resume with other options than the run's is refused, except
    schedule options with ``allow_schedule_changes`` (recorded in ``resumes.jsonl``). Raises
    :class:`RunFolderError` for an unusable folder or resume. A run that stops before its first
    checkpoint leaves nothing behind; Ctrl-C raises ``KeyboardInterrupt`` with one line saying what
    was kept.
    """
    plan = check_config(config)
    ctx = setup_distributed(plan.train.device)
    out_dir = Path(broadcast_object(str(out_dir or _default_out_dir(plan)), ctx)).expanduser()
    made = _made_folders(out_dir)
    continued = resume and bool(run_entries(out_dir))  # a resume of a run that is there (else: a new run)
    problem, removed, kept, changes = None, [], [], {}
    if ctx.is_main:  # one process decides, before any process writes
        try:
            removed, kept = prepare_run_folder(out_dir, resume=resume, overwrite=overwrite)
            if resume:
                changes = _check_resume(out_dir, plan, allow_schedule_changes)
        except RunFolderError as err:
            problem = str(err)
    problem = broadcast_object(problem, ctx)
    if problem is not None:
        raise RunFolderError(problem)
    barrier(ctx)
    try:
        if removed:
            logger.info("overwrite: deleted the previous run in %s (%s)%s", out_dir, ", ".join(removed),
                        f"; kept what is not a run's: {', '.join(kept)}" if kept else "")
        if plan.from_dataset:
            logger.info("model options from the defaults for dataset %s: %s (--set model.KEY=VALUE to change)", plan.data,
                        ", ".join(f"{k}={plan.model_options[k]}" for k in plan.from_dataset))
        data = load_dataset(plan.data, plan.data_path, **plan.data_options)
        torch.manual_seed(plan.train.seed)
        model = _build(plan, data)
        if ctx.is_main:
            _record_start(out_dir, resume, changes)
            _write_run_files(out_dir, plan, data)
            n_params = sum(p.numel() for p in model.parameters())
            logger.info("%s (%s parameters) on %s (%d train / %d test), %d process(es) on %s; writing %s", plan.model,
                        f"{n_params:,}", plan.data, len(data.train), len(data.test), ctx.world_size, ctx.device, out_dir)
        return train(model, data, plan.train, out_dir=out_dir, resume=resume, callbacks=callbacks,
                     allow_schedule_changes=allow_schedule_changes)
    except BaseException as err:
        if not ctx.is_main:
            raise
        what = _after_a_stop(out_dir, continued, made)
        if isinstance(err, KeyboardInterrupt):
            raise KeyboardInterrupt(f"interrupted: {what}") from None
        logger.debug("%s", what)  # the error says what went wrong; a run that failed to start leaves nothing
        raise


def _format_options(options: dict[str, Any]) -> str:
    return ", ".join(name if default is REQUIRED else f"{name}={default!r}" for name, default in options.items())


def describe_options() -> str:
    """Every model, dataset and train option with its default (for ``sinkformer train --help``)."""
    lines = ["models (--model NAME; options: --set model.KEY=VALUE; sizes without default come from the data):"]
    lines += [f"  {name} [{cls.input_kind}]: {_format_options(model_options(name))}" for name, cls in MODELS.items()]
    lines.append("datasets (--dataset NAME; options: --set data.KEY=VALUE; real ones need --data PATH):")
    for name, spec in DATASETS.items():
        where = "embedded" if spec.embedded else "needs --data PATH"
        lines.append(f"  {name} [{spec.kind}, {where}]: {_format_options(dataset_options(name)) or '-'}")
        if name in DATASET_MODEL_DEFAULTS:
            lines.append(f"      model options it sets unless given: {_format_options(DATASET_MODEL_DEFAULTS[name])}")
    lines.append("train options (--set train.KEY=VALUE):")
    lines.append("  " + _format_options({k: (list(v) if isinstance(v, tuple) else v)
                                         for k, v in TrainConfig().to_dict().items()}))
    return "\n".join(lines)
