"""benchmarks/matvec.py: every product the engines' row sums can take, timed on this CPU, and the one the
library picks; the command writes its JSON and table."""

import json

import pytest
import torch

from benchmarks import matvec
from sinkformer.sinkhorn import scaling, sizes


@pytest.mark.parametrize("row_vector, loop_slices, c, expected", [
    (True, 8, 32, "row-vector"), (False, 8, 8, "per-slice"), (False, 8, 2, "per-slice"), (False, 8, 9, "batched"),
    (False, 8, 1, "batched"), (False, 0, 2, "batched")])
def test_the_library_picks_by_the_two_constants(monkeypatch, row_vector, loop_slices, c, expected):
    monkeypatch.setattr(sizes, "ROW_VECTOR_PRODUCTS", row_vector)
    monkeypatch.setattr(sizes, "MATVEC_LOOP_SLICES", loop_slices)
    assert scaling.row_product(torch.empty(c, 3, 4)) == expected
    assert scaling.row_product(torch.empty(c, 3, 4, device="meta")) == "batched"  # not a CPU tensor


def test_each_forced_product_is_the_one_timed_and_all_agree(monkeypatch):
    seen = []
    real = torch.addmv
    monkeypatch.setattr(torch, "addmv", lambda *a, **k: seen.append("addmv") or real(*a, **k))
    before = (sizes.ROW_VECTOR_PRODUCTS, sizes.MATVEC_LOOP_SLICES)
    rows = matvec.measure(blocks=((3, 5, 7),), threads=(1,), rounds=1, repeats=1)
    assert (sizes.ROW_VECTOR_PRODUCTS, sizes.MATVEC_LOOP_SLICES) == before  # the constants are put back
    assert seen  # the per-slice method ran add_rows_times's addmv branch
    (row,) = rows
    assert set(matvec.METHODS) | {"column sums", "library", "fastest"} <= set(row)
    assert row["library"] == scaling.row_product(torch.empty(3, 5, 7)) and row["fastest"] in matvec.METHODS
    g = torch.Generator().manual_seed(1)
    K, x, add = torch.rand(3, 5, 7, generator=g), torch.rand(3, 7, 1, generator=g), torch.rand(3, 5, 1, generator=g)
    results = []
    for method, (row_vector, loop_slices) in matvec.METHODS.items():
        monkeypatch.setattr(sizes, "ROW_VECTOR_PRODUCTS", row_vector)
        monkeypatch.setattr(sizes, "MATVEC_LOOP_SLICES", loop_slices)
        assert scaling.row_product(K) == method
        results.append(scaling.add_rows_times(add, K, x, torch.empty(3, 5, 1)))
    for out in results:
        torch.testing.assert_close(out, add + K @ x)


def test_the_command_writes_json_and_table(tmp_path, monkeypatch):
    monkeypatch.setattr(matvec, "BLOCKS", ((2, 4, 6), (1, 4, 6)))
    assert matvec.main(["--rounds", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "matvec.json").read_text())
    assert [(r["c"], r["threads"]) for r in data["rows"]] == [(2, 1), (1, 1), (2, 2), (1, 2)]
    assert all(r["per-slice"] is None for r in data["rows"] if r["c"] == 1)  # never taken for one slice
    text = (tmp_path / "matvec.md").read_text()
    assert "| 1 | 2 × 4 × 6 |" in text and "| 1 | 1 × 4 × 6 | " in text and "library picks" in text
    assert "more than 1.1×" in text and " – |" in text
