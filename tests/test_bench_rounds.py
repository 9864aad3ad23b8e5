"""The benchmarks' rounds: every column timed once a round, every other round in reverse order (CPU)."""

import pytest

from mla_multi.benchmarks import in_turn, prefill


def test_in_turn_reverses_every_other_round():
    runs = ["triton", "flashinfer", "cudnn"]
    assert [in_turn(runs, index) for index in range(4)] == [
        runs, runs[::-1], runs, runs[::-1]
    ]
    assert runs == ["triton", "flashinfer", "cudnn"]  # the caller's list is left as it was


def test_prefill_rounds_time_every_column_in_alternating_order(monkeypatch):
    """`_time_rows` times each column once a round (eager, then captured), in the order of `in_turn`, keeps
    every round and reports the median: a fake clock gives each call a time that names the column and round."""
    order = []

    class Graph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            return self.name

    import mla_multi.testing

    monkeypatch.setattr(mla_multi.testing, "capture_graph", lambda run: Graph(run()))
    monkeypatch.setattr(prefill.torch.cuda, "synchronize", lambda: None)
    times = {"a": [3.0, 1.0, 2.0], "b": [5.0, 6.0, 4.0]}
    calls = {"a": 0, "b": 0}

    def fake_bench(fn):
        name = fn()
        if isinstance(fn, type(Graph("x").replay)):  # a captured replay
            order.append(name)
            value = times[name][calls[name]]
            calls[name] += 1
            return value
        return 100.0  # an eager call

    monkeypatch.setattr(prefill, "_bench", fake_bench)
    row = {"_runs": [("a", lambda: "a"), ("b", lambda: "b")], "notes": [], "ms": {}, "tflops": {}}
    prefill._time_rows(row, flops=1e9, rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert row["ms_rounds"] == {"a": [3.0, 1.0, 2.0], "b": [5.0, 6.0, 4.0]}
    assert row["ms"] == {"a": 2.0, "b": 5.0}
    assert row["eager_ms"] == {"a": 100.0, "b": 100.0}
    assert row["tflops"]["a"] == pytest.approx(1e9 / 2.0 / 1e9)
    assert row["notes"] == []
