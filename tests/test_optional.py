"""The core needs torch, numpy and einops only; optional modules fail with the extra to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from sinkformer._optional import EXTRAS, require

# A child interpreter in which every optional package is unimportable (as on a core-only install).
BLOCK = textwrap.dedent(
    """
    import sys
    BLOCKED = {blocked!r}
    for name in BLOCKED:
        sys.modules[name] = None  # `import name` now raises ModuleNotFoundError, as if not installed
    """
)


def run_without_extras(code: str) -> subprocess.CompletedProcess:
    script = BLOCK.format(blocked=sorted(EXTRAS)) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_core_runs_without_optional_packages():
    done = run_without_extras(
        """
        import torch, sinkformer
        q = k = v = torch.randn(2, 4, 16, 8)
        out = sinkformer.attention(q, k, v, normalization="sinkhorn", n_iters=5)
        mha = sinkformer.nn.MultiheadAttention(32, 4, normalization="sinkhorn", batch_first=True)
        x = torch.randn(2, 16, 32)
        y, _ = mha(x, x, x)
        layer = sinkformer.convert(torch.nn.TransformerEncoderLayer(32, 4, batch_first=True))
        layer(x)
        import sinkformer.dynamics
        print("ok", tuple(out.shape), tuple(y.shape), sorted(m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in BLOCKED))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "ok (2, 4, 16, 8) (2, 16, 32) []"


def test_missing_extra_names_the_install_command():
    done = run_without_extras(
        """
        from sinkformer.plotting import pyplot
        pyplot()
        """
    )
    assert done.returncode != 0
    assert "plotting needs matplotlib" in done.stderr
    assert "pip install 'sinkformer[experiments]'" in done.stderr


@pytest.mark.parametrize("module", ["yaml", "ot", "sacrebleu"])
def test_require_names_distribution_and_extra(monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ModuleNotFoundError
    distribution, extra = EXTRAS[module]
    with pytest.raises(ImportError, match=rf"testing needs {distribution}.*sinkformer\[{extra}\]"):
        require(module, "testing")


def test_require_returns_the_module_and_reraises_unrelated_errors(monkeypatch):
    import json

    assert require("json") is json
    with pytest.raises(ModuleNotFoundError, match="no_such_module_xyz"):
        require("no_such_module_xyz")


def _extras_in_pyproject() -> dict[str, set[str]]:
    """Each extra of pyproject.toml -> the distributions it installs, included extras resolved (lowercase names)."""
    import re
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not running from sinkformer's source checkout")
    declared = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]

    def resolve(extra: str) -> set[str]:
        names = set()
        for requirement in declared[extra]:
            included = re.fullmatch(r"sinkformer\[(.*)\]", requirement.strip())
            if included:
                names |= {d for e in included.group(1).split(",") for d in resolve(e.strip())}
            else:
                names.add(re.split(r"[<>=!;\[ ]", requirement, maxsplit=1)[0].lower())
        return names

    return {extra: resolve(extra) for extra in declared}


def test_each_extra_installs_the_modules_the_code_says_it_brings():
    """_optional.EXTRA_MODULES (what the errors tell users to install) agrees with pyproject.toml; the
    experiments extra brings transformers, which `sinkformer run`'s hidden-states experiment needs."""
    from sinkformer._optional import EXTRA_MODULES

    installed = _extras_in_pyproject()
    for extra, modules in EXTRA_MODULES.items():
        wanted = {EXTRAS[m][0].lower() for m in modules}
        assert wanted <= installed[extra], f"extra {extra!r} lacks {sorted(wanted - installed[extra])}"
    assert "transformers" in installed["experiments"]
