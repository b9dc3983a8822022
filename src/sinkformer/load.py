"""Use a trained run again: :func:`load_run` a run folder, :func:`predict` with it.

A folder written by ``sinkformer train`` (or :func:`~sinkformer.training.runner.run_training`)
holds the resolved configuration (``config.yaml``), the dataset's description
(``data_info.json``: sizes, class names), the tokenizer of text data (``tokenizer.json``) and
the weights (``model.safetensors``, and ``checkpoints/epoch_NNNN/``). That is all
:func:`load_run` reads — not the dataset::

    import sinkformer

    run = sinkformer.load_run("runs/train/text_classifier-sinkhorn-sentiment-20250101-120000")
    sinkformer.predict(run, "the plot was not very good")             # -> "negative"
    sinkformer.predict(run, ["a superb film", "the cast was dull"])   # -> ["positive", "negative"]

:func:`predict` per kind of data (``run.info["kind"]``), one input -> one output:

* ``tokens``: a text ``str`` (NLI: a ``(premise, hypothesis)`` pair) -> the class name;
* ``images``: a ``(C, H, W)`` float tensor, preprocessed as the dataset does (digits: values in
  [0, 1]; see the dataset's loader) -> the class name;
* ``points``: an ``(n, 3)`` float tensor -> the class name;
* ``translation``: a source sentence ``str`` -> its translation ``str`` (greedy decoding); without
  a tokenizer (sorting) a 1-D tensor of token ids -> a list of ids.

Class names come from ``info["class_names"]``; a dataset without names gives class indices.
A list of inputs (or a batched tensor ``(B, C, H, W)`` / ``(B, n, 3)``) gives a list of outputs.
Texts are encoded exactly as the dataset encoded its training texts (same tokenizer, same
truncation to ``info["max_len"]``). :func:`logits` gives the classifiers' scores instead of names.
Language models (kind ``lm``) have no :func:`predict`: use ``run.model`` directly.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ._optional import require

__all__ = ["LoadedRun", "load_run", "predict", "logits", "encode_inputs"]


@dataclass
class LoadedRun:
    """A trained model ready to use, with what it needs to read raw inputs.

    Attributes:
        model: the model, in eval mode, with the run's weights.
        tokenizer: the run's ``tokenizers.Tokenizer`` (text data), else ``None``.
        config: the resolved configuration (``model``, ``data``, ``train`` sections).
        info: the dataset's ``info`` (``kind``, sizes, ``class_names`` when the data has them).
        path: the run folder (``None`` for a run assembled in memory).
        weights: the weights file loaded.
    """

    model: torch.nn.Module
    tokenizer: Any
    config: dict[str, Any]
    info: dict[str, Any]
    path: Path | None = None
    weights: Path | None = field(default=None, repr=False)

    @property
    def kind(self) -> str:
        return self.info["kind"]

    def __repr__(self) -> str:
        model = (self.config.get("model") or {}).get("name", type(self.model).__name__)
        data = (self.config.get("data") or {}).get("name", "?")
        return (f"LoadedRun({model} on {data} [{self.kind}], tokenizer={'yes' if self.tokenizer is not None else 'no'}, "
                f"path={str(self.path) if self.path else None!r})")

    def predict(self, inputs: Any) -> Any:
        """:func:`predict` with this run."""
        return predict(self, inputs)


def _weights_file(path: Path, epoch: int | None) -> Path:
    from .training.checkpoint import latest_checkpoint, list_checkpoints

    if epoch is not None:
        folder = path / "checkpoints" / f"epoch_{epoch:04d}"
        if not folder.is_dir():
            have = ", ".join(str(int(p.name.split("_")[1])) for p in list_checkpoints(path / "checkpoints")) or "none"
            raise FileNotFoundError(f"run {path} has no checkpoint of epoch {epoch} (checkpoints kept: {have})")
        return folder / "model.safetensors"
    final = path / "model.safetensors"
    if final.exists():
        return final
    checkpoint = latest_checkpoint(path / "checkpoints")
    if checkpoint is None:
        raise FileNotFoundError(f"run {path} has no weights: neither model.safetensors nor a checkpoint")
    warnings.warn(f"run {path} has not finished (no model.safetensors): using its newest checkpoint, {checkpoint.name}",
                  stacklevel=3)
    return checkpoint / "model.safetensors"


def load_run(path: str | Path, *, epoch: int | None = None, device: str | torch.device = "cpu") -> LoadedRun:
    """Load the model of run folder ``path`` (in eval mode, on ``device``) with its tokenizer.

    ``epoch``: ``None`` for the final weights (``model.safetensors``; the newest complete
    checkpoint, with a warning, if the run has not finished), or the epoch of a kept checkpoint.
    The model is rebuilt from ``config.yaml`` and ``data_info.json``; a folder written before
    ``data_info.json`` existed has its dataset loaded once to recover ``info`` and the tokenizer.
    Raises ``FileNotFoundError`` for a missing folder or weights, ``ValueError`` for a folder
    that is not a run or an incomplete weights file.
    """
    yaml = require("yaml", "load_run")

    from .models import build_model
    from .training.checkpoint import load_weights
    from .training.runner import CONFIG_FILE, DATA_INFO_FILE, TOKENIZER_FILE

    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such run folder")
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{path} is not a run folder: it has no {CONFIG_FILE}")
    config = yaml.safe_load((path / CONFIG_FILE).read_text(encoding="utf-8")) or {}
    model_options = dict(config.get("model") or {})
    name = model_options.pop("name", None)
    if name is None:
        raise ValueError(f"{path / CONFIG_FILE} names no model (model.name)")
    weights = _weights_file(path, epoch)

    tokenizer = None
    if (path / DATA_INFO_FILE).is_file():
        info = json.loads((path / DATA_INFO_FILE).read_text(encoding="utf-8"))
        if (path / TOKENIZER_FILE).is_file():
            Tokenizer = require("tokenizers", "the run's tokenizer").Tokenizer
            tokenizer = Tokenizer.from_file(str(path / TOKENIZER_FILE))
    else:  # a run folder of an older version: the dataset describes itself
        from .data import load_dataset

        data_options = dict(config.get("data") or {})
        warnings.warn(f"run {path} has no {DATA_INFO_FILE}: loading dataset {data_options.get('name')!r} to rebuild "
                      f"the model", stacklevel=2)
        data = load_dataset(data_options.pop("name"), data_options.pop("path", None), **data_options)
        info, tokenizer = data.info, data.tokenizer

    model = build_model(name, info, **model_options).to(device)
    load_weights(model, weights)
    model.eval()
    return LoadedRun(model, tokenizer, config, info, path, weights)


# --- inputs -> batches ----------------------------------------------------------------------------------------


def _is_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and all(isinstance(s, str) for s in x)


def _split(run: LoadedRun, inputs: Any) -> tuple[list[Any], bool]:
    """``(items, single)``: the inputs as a list, and whether one input (not a list) was given."""
    kind = run.kind
    if isinstance(inputs, Tensor):
        item_dims = {"images": 3, "points": 2, "translation": 1}.get(kind)
        if item_dims is None:
            raise ValueError(f"predict takes texts for a {kind} run, not a tensor")
        if inputs.dim() == item_dims:
            return [inputs], True
        if inputs.dim() == item_dims + 1:
            return list(inputs), False
        raise ValueError(f"expected a tensor of {item_dims} dimensions (one input) or {item_dims + 1} (a batch) "
                         f"for a {kind} run, got shape {tuple(inputs.shape)}")
    if isinstance(inputs, str) or _is_pair(inputs):
        return [inputs], True
    items = list(inputs)
    if not items:
        raise ValueError("predict got no inputs")
    return items, False


def _text_ids(run: LoadedRun, items: list[Any]) -> list[Tensor]:
    from .data.nli import _encode_pairs
    from .data.text import encode

    if run.tokenizer is None:
        raise ValueError(f"run {run.path} has no tokenizer (tokenizer.json is missing): it cannot read text")
    max_len = run.info.get("max_len", 512)
    if all(_is_pair(x) for x in items):
        return _encode_pairs(run.tokenizer, [p for p, _ in items], [h for _, h in items], max_len)
    if not all(isinstance(x, str) for x in items):
        raise ValueError("a text classifier reads texts (str), or (premise, hypothesis) pairs for NLI")
    return encode(run.tokenizer, items, max_len)


def encode_inputs(run: LoadedRun, inputs: Any) -> dict[str, Tensor]:
    """The keyword inputs of ``run.model`` (a collated batch, on the model's device) for raw ``inputs``.

    For translation runs the batch holds ``src`` and ``src_padding_mask`` (what decoding reads).
    """
    from .data.base import FixedCollate, TokenCollate, _pad

    items, _ = _split(run, inputs)
    kind, info = run.kind, run.info
    if kind == "tokens":
        batch, _ = TokenCollate(info.get("pad_id", 0))([(ids, 0) for ids in _text_ids(run, items)])
    elif kind in ("images", "points"):
        tensors = []
        for x in items:
            x = torch.as_tensor(x, dtype=torch.float32)
            expected = (info.get("channels"), info.get("image_size"), info.get("image_size")) if kind == "images" else None
            if expected is not None and None not in expected and tuple(x.shape) != expected:
                raise ValueError(f"this run reads images of shape (C, H, W) = {expected}, got {tuple(x.shape)}")
            if kind == "points" and (x.dim() != 2 or x.shape[-1] != info.get("in_features", 3)):
                raise ValueError(f"this run reads point clouds of shape (n, {info.get('in_features', 3)}), "
                                 f"got {tuple(x.shape)}")
            tensors.append(x)
        batch, _ = FixedCollate(kind)([(x, 0) for x in tensors])
    elif kind == "translation":
        pad_id, eos_id = info.get("pad_id", 0), info.get("eos_id", 2)
        if run.tokenizer is None:  # ids as the dataset feeds them (e.g. sorting)
            src = [torch.as_tensor(x, dtype=torch.long) for x in items]
            if any(x.dim() != 1 for x in src):
                raise ValueError("a translation run without a tokenizer reads 1-D tensors of token ids")
        else:
            if not all(isinstance(x, str) for x in items):
                raise ValueError("a translation run with a tokenizer reads source sentences (str)")
            from .data.text import encode

            src = [torch.cat([ids, torch.tensor([eos_id])])
                   for ids in encode(run.tokenizer, items, info.get("max_len", 256) - 1)]
        ids, mask = _pad(src, pad_id)
        batch = {"src": ids, "src_padding_mask": mask}
    else:
        raise ValueError(f"predict does not handle {kind!r} runs (language models): use run.model directly")
    device = next(run.model.parameters()).device
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def logits(run: LoadedRun, inputs: Any) -> Tensor:
    """The class scores ``(B, n_classes)`` of a classifier run (tokens, images, points) for ``inputs``."""
    if run.kind not in ("tokens", "images", "points"):
        raise ValueError(f"logits are for classifier runs (tokens, images, points), not {run.kind!r}")
    run.model.eval()
    return run.model(**encode_inputs(run, inputs))


@torch.no_grad()
def predict(run: LoadedRun, inputs: Any) -> Any:
    """Classify or translate raw ``inputs`` with a loaded run (see the module's table).

    One input gives one output, a list (or a batched tensor) a list: class names (from
    ``run.info["class_names"]``; the class index without them) for classifiers, translated
    sentences (greedy decoding) for translation runs.
    """
    _, single = _split(run, inputs)
    if run.kind == "translation":
        from .models.decoding import greedy_decode

        run.model.eval()
        batch = encode_inputs(run, inputs)
        ids = greedy_decode(run.model, batch["src"], batch["src_padding_mask"])
        outputs = ids if run.tokenizer is None else [run.tokenizer.decode(x, skip_special_tokens=True) for x in ids]
    else:
        classes = logits(run, inputs).argmax(-1).tolist()
        names = run.info.get("class_names")
        outputs = [names[c] if names else c for c in classes]
    return outputs[0] if single else outputs
