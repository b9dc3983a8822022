"""benchmarks/sharing.py: its table and verdict from measured rows (the measurement itself is a benchmark)."""

from benchmarks import sharing


def rows(default_busy: float) -> list[dict]:
    return [{"busy": 0, "threads": "default (free cores)", "epoch_s": 2.0, "rounds": [2.0]},
            {"busy": 0, "threads": "2", "epoch_s": 1.8, "rounds": [1.8]},
            {"busy": 1, "threads": "default (free cores)", "epoch_s": default_busy, "rounds": [default_busy]},
            {"busy": 1, "threads": "2", "epoch_s": 14.4, "rounds": [14.4]}]


META = {"when": "now", "torch": "x", "cores": 2, "rounds": 1, "epochs": 3, "busy": 1}


def test_the_table_gives_each_setting_as_a_multiple_of_its_time_alone():
    text = sharing.render(rows(2.6), META)
    assert "| 1 | 2 | 14.40 | 8.00 |" in text and "| 1 | default (free cores) | 2.60 | 1.30 |" in text
    assert "**1.30** (met)" in text
    assert "**1.60** (missed)" in sharing.render(rows(3.2), META)
