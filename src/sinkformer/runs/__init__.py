"""The run framework: the experiment registry, run folders and their provenance, logging, reports
(markdown and HTML), the multi-process suite, and the statistics of verdicts.

Experiments themselves (content only) live in :mod:`sinkformer.experiments`, grouped by paper.
(``sinkformer.runs.registry`` is the module; its function ``registry()`` lists the experiments.)
"""

from .registry import Experiment, Run, get, parse_overrides, register, run_experiment
from .report import (
    atomic_write,
    format_number,
    markdown_table,
    new_run_dir,
    render_html,
)
from .training import fit, training_seconds

__all__ = [
    "Experiment", "Run", "register", "get", "parse_overrides", "run_experiment", "markdown_table",
    "format_number", "render_html", "new_run_dir", "atomic_write", "fit", "training_seconds",
]
