"""The figures people read: the demo (Sinkformers Figure 1) and the benchmark plots.

These inspect the matplotlib artists of the figures, not pixels: which links the demo draws and
how wide and opaque they are, and that the benchmark plots give one colour per method and one line
style per number of Sinkhorn iterations.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")

from matplotlib.colors import to_rgba

from sinkformer.experiments.sinkformers import _common as sinkformers_common
from sinkformer.experiments.sinkformers import normalizations
from sinkformer.plotting import SINKFORMER_COLOR, TRANSFORMER_COLOR, method_color

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import attention as attention_bench
from benchmarks import sparse_memory as sparse_bench


# ----------------------------------------------------------------------------- the demo


def _links(ax):
    (links,) = [c for c in ax.collections if c.get_gid() == "links"]
    return links


@pytest.fixture(scope="module")
def demo():
    result = normalizations.compute(n_points=10, seed=0)
    fig = normalizations.figure(result)
    yield result, fig
    normalizations.pyplot().close(fig)


def test_demo_draws_every_link_above_the_threshold_and_nothing_else(demo):
    result, fig = demo
    panels = fig.axes[:3]
    assert [ax.get_title().split("\n")[0] for ax in panels][2].startswith(r"$K^\infty$")
    q, k = result.queries.numpy(), result.keys.numpy()
    for ax, K in zip(panels, result.matrices.values()):
        segments = _links(ax).get_segments()
        expected = {(i, j) for i, j in zip(*(K >= normalizations.LINK_THRESHOLD).nonzero(as_tuple=True))}
        assert len(segments) == len(expected)
        drawn = set()
        for seg in segments:
            i = int(((q - seg[0]) ** 2).sum(1).argmin())
            j = int(((k - seg[1]) ** 2).sum(1).argmin())
            assert ((q[i] - seg[0]) ** 2).sum() < 1e-20 and ((k[j] - seg[1]) ** 2).sum() < 1e-20
            drawn.add((torch.tensor(i), torch.tensor(j)))
        assert {(int(a), int(b)) for a, b in drawn} == {(int(a), int(b)) for a, b in expected}
    # SoftMax reaches half the keys, Sinkhorn all 100 pairs
    assert len(_links(panels[1]).get_segments()) == 50
    assert len(_links(panels[2]).get_segments()) == 100


def test_demo_kinf_widths_and_alphas_lie_in_the_stated_range_and_follow_k(demo):
    result, fig = demo
    (w_lo, w_hi), (a_lo, a_hi) = normalizations.LINK_WIDTH, normalizations.LINK_ALPHA
    assert 0 < w_lo < w_hi and 0 < a_lo < a_hi <= 1
    for ax, K in zip(fig.axes[:3], result.matrices.values()):
        links = _links(ax)
        widths = torch.tensor(links.get_linewidths(), dtype=torch.float64)
        alphas = torch.tensor(links.get_colors()[:, 3], dtype=torch.float64)
        assert widths.min() >= w_lo - 1e-9 and widths.max() <= w_hi + 1e-9
        assert alphas.min() >= a_lo - 1e-9 and alphas.max() <= a_hi + 1e-9
        # the panel's largest entry gets the full width and opacity (scale relative to the panel)
        assert widths.max() == pytest.approx(w_hi) and alphas.max() == pytest.approx(a_hi)
        # linear in K_ij / max K, lightest drawn first (heavy links on top)
        pairs, _, _ = normalizations.link_styles(K)
        rel = torch.tensor([float(K[i, j] / K.max()) for i, j in pairs], dtype=torch.float64)
        torch.testing.assert_close(widths, w_lo + (w_hi - w_lo) * rel)
        torch.testing.assert_close(alphas, a_lo + (a_hi - a_lo) * rel)
        assert bool((rel[1:] >= rel[:-1]).all())
    # K^inf: doubly stochastic, its weakest link is still drawn above the floor
    Kinf = result.matrices["Kinf"]
    kinf_widths = torch.tensor(_links(fig.axes[2]).get_linewidths(), dtype=torch.float64)
    assert kinf_widths.min() > w_lo and float(Kinf.min() / Kinf.max()) > 1e-3
    # the figure says what width and opacity encode
    text = fig._suptitle.get_text()
    assert "width" in text and "opacity" in text and f"{w_lo:g}" in text and f"{w_hi:g}" in text


def test_demo_inset_zooms_on_the_near_cloud(demo):
    _, fig = demo
    for ax in fig.axes[:3]:
        (inset,) = ax.child_axes
        assert len(_links(inset).get_segments()) == len(_links(ax).get_segments())
        x0, x1 = inset.get_xlim()
        assert x1 - x0 < 0.5 * (ax.get_xlim()[1] - ax.get_xlim()[0])


def test_demo_png_is_small_enough_for_the_readme(tmp_path):
    path = normalizations.plot(normalizations.compute(), tmp_path / "demo.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size < 600_000


# ----------------------------------------------------------------------------- shared colours


def test_transformer_and_sinkformer_have_one_colour_everywhere():
    assert sinkformers_common.COLORS[sinkformers_common.TRANSFORMER] == TRANSFORMER_COLOR
    assert sinkformers_common.COLORS[sinkformers_common.SINKFORMER] == SINKFORMER_COLOR
    assert to_rgba(TRANSFORMER_COLOR) != to_rgba(SINKFORMER_COLOR)
    assert method_color("sdpa") == method_color("Transformer") == method_color("vanilla") == TRANSFORMER_COLOR
    assert method_color("ours") == method_color("Sinkformer (5 it.)") == method_color("sinkhorn") == SINKFORMER_COLOR
    assert method_color("Sinkhorn Mixture (16)") not in (TRANSFORMER_COLOR, SINKFORMER_COLOR)
    assert method_color("something else", default="k") == "k"


# ----------------------------------------------------------------------------- benchmark plots


def _attention_rows():
    rows = []
    for n in (256, 1024):
        for method in attention_bench.METHODS:
            for it in ([1] if method in attention_bench.SOFTMAX_METHODS else [1, 5, 21]):
                row = dict(method=method, b=attention_bench.B, h=attention_bench.H, n=n, d=attention_bench.D,
                           n_iters=it, forward_ms=1.0, forward_backward_ms=n * (1 + it) * 0.01,
                           peak_mib=n * 0.1 * (1 + (it if method == "paper-reference" else 0)))
                if method == "paper-reference" and n == 1024 and it == 21:
                    row = {k: v for k, v in row.items() if k not in ("forward_ms", "forward_backward_ms", "peak_mib")}
                    row["error"] = "skipped: needs about 14 GiB"
                rows.append(row)
    rows.append(dict(method="ours-chunked", b=1, h=1, n=8192, d=64, n_iters=5, forward_ms=1.0,
                     forward_backward_ms=1.0, peak_mib=1.0))  # the long run: not on these axes
    return rows


def _look(line) -> tuple:
    """(dash pattern, marker) of a line: what tells the n_iters apart."""
    dashes = getattr(line, "_unscaled_dash_pattern", None)  # the dash sequence ('--' names several)
    return line.get_linestyle(), str(dashes), line.get_marker()


@pytest.mark.parametrize("iters, shown", [(None, [5, 21]), ([1, 5, 21], [1, 5, 21])])
def test_attention_plot_one_colour_per_method_one_style_per_n_iters(tmp_path, iters, shown):
    fig = attention_bench.plot(_attention_rows(), tmp_path / "attention.png", iters=iters)
    assert (tmp_path / "attention.png").stat().st_size > 10_000
    for ax in fig.axes:
        lines = ax.get_lines()
        by_method, by_iters = {}, {}
        for line in lines:
            label = line.get_label()
            method, _, it = label.partition(", n_iters=")
            assert method in attention_bench.METHODS
            by_method.setdefault(method, set()).add(to_rgba(line.get_color()))
            key = int(it) if it else "softmax"
            by_iters.setdefault(key, set()).add(_look(line))
            assert all(x == 256 or x == 1024 for x in line.get_xdata())  # b != B rows left out
        # every method drawn, each in exactly one colour, no two methods share one
        assert set(by_method) == set(attention_bench.METHODS)
        colours = [next(iter(c)) for c in by_method.values()]
        assert all(len(c) == 1 for c in by_method.values()) and len(set(colours)) == len(colours)
        # one (line style, marker) per n_iters, distinct across n_iters and from the SoftMax style
        assert set(by_iters) == {"softmax", *shown}
        assert all(len(s) == 1 for s in by_iters.values())
        looks = [next(iter(s)) for s in by_iters.values()]
        assert len({lk[:2] for lk in looks}) == len(looks), "two n_iters share a line style"
        assert len({lk[2] for lk in looks}) == len(looks), "two n_iters share a marker"
        # Sinkhorn methods: one line per n_iters shown (paper-reference at n=1024, 21 it. is an error row)
        softmax = len(attention_bench.SOFTMAX_METHODS)
        assert len(lines) == softmax + (len(attention_bench.METHODS) - softmax) * len(shown)
    # the shared colours: SDPA is the Transformer colour, ours the Sinkformer one
    line = next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == "sdpa")
    assert to_rgba(line.get_color()) == to_rgba(TRANSFORMER_COLOR)
    line = next(ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("ours,"))
    assert to_rgba(line.get_color()) == to_rgba(SINKFORMER_COLOR)
    # two legends that say what colour and line style mean
    titles = sorted(legend.get_title().get_text() for legend in fig.legends)
    assert titles == ["method (colour)", "n_iters (line style)"]
    style_legend = next(lg for lg in fig.legends if lg.get_title().get_text().startswith("n_iters"))
    assert [t.get_text() for t in style_legend.get_texts()][1:] == [
        f"{it} iteration{'s' if it > 1 else ''}" for it in shown]
    if 21 in shown:
        assert "not run" in fig._suptitle.get_text() and "paper-reference at n=1024" in fig._suptitle.get_text()


def test_attention_plot_only_redraws_from_the_json_without_measuring(tmp_path, monkeypatch):
    import json

    (tmp_path / "attention.json").write_text(json.dumps({"rows": _attention_rows()}))
    monkeypatch.setattr(attention_bench, "run", lambda configs: pytest.fail("--plot-only must not measure"))
    assert attention_bench.main(["--plot-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "attention.png").read_bytes()[:4] == b"\x89PNG"


def test_sparse_memory_plot_one_colour_and_marker_per_method(tmp_path):
    rows = [dict(method=m, length=n, peak_mib=n / 100 * (k + 1), saved_mib=n / 1000, seconds=n / 1e4)
            for k, m in enumerate(sparse_bench.METHODS) for n in (1024, 2048, 4096)]
    rows.append(dict(method="vanilla", length=8192, error="skipped"))
    fig = sparse_bench.plot(rows, tmp_path / "sparse_memory.png")
    for ax in fig.axes:
        lines = ax.get_lines()
        assert [ln.get_label() for ln in lines] == list(sparse_bench.METHODS)
        looks = {(to_rgba(ln.get_color()), ln.get_marker(), ln.get_linestyle()) for ln in lines}
        assert len(looks) == len(lines) and len({to_rgba(ln.get_color()) for ln in lines}) == len(lines)
        assert ax.get_xlabel() and ax.get_ylabel()
    # identical saved-memory curves (vanilla-sdpa and local here) stay visible: open markers drawn on top
    sdpa = next(ln for ln in fig.axes[1].get_lines() if ln.get_label() == "vanilla-sdpa")
    local = next(ln for ln in fig.axes[1].get_lines() if ln.get_label() == "local")
    assert sdpa.get_zorder() > local.get_zorder() and sdpa.get_markerfacecolor() == "white"
    assert [lg.get_title().get_text() for lg in fig.legends] == ["method"]


# ----------------------------------------------------------------------------- experiment figures


def test_sparse_bar_figure_uses_the_method_colours_and_prints_the_values():
    from sinkformer.experiments.sparse._common import bar_figure

    labels = ["Transformer", "Sinkhorn Transformer (16)", "Sparse Transformer"]
    fig = bar_figure(labels, {"perplexity ↓": [20.79, 19.86, float("nan")]}, "Language modelling")
    ax = fig.axes[0]
    colours = [to_rgba(bar.get_facecolor()) for bar in ax.patches]
    assert colours[0] == to_rgba(TRANSFORMER_COLOR) and colours[1] == to_rgba(SINKFORMER_COLOR)
    assert colours[2] not in colours[:2]
    values = [t.get_text() for t in ax.texts]
    assert values == ["20.79", "19.86", "n/a"]
    assert ax.get_xlabel() == "perplexity, lower is better"
    normalizations.pyplot().close(fig)
