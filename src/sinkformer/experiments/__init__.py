"""The papers' experiments, content only, one package per paper family:

* :mod:`.sinkformers` — Sander et al. 2022 (Sinkformers): Transformer vs Sinkformer;
* :mod:`.sparse` — Tay et al. 2020 (Sparse Sinkhorn Attention);
* :mod:`.dynamics` — Transformers as interacting particles (Castin et al.; Agarwal et al.; Sinkformers §5).

Each module registers its experiments with :func:`sinkformer.runs.register`; the framework that runs
them (registry, run folders, reports, the suite) is :mod:`sinkformer.runs`.
"""
