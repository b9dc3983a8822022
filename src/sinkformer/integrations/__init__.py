"""Bridges to other libraries, each an optional extra imported only on request.

* :mod:`sinkformer.integrations.huggingface` — Sinkhorn attention as a Hugging Face
  ``transformers`` attention backend (``pip install "sinkformer[hf]"``).

Importing ``sinkformer`` or this package never imports the third-party library; only
importing the submodule does.
"""
