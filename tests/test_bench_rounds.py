"""The benchmarks' rounds: every column timed once a round, every other round in reverse order (CPU)."""

import pytest

from mla_multi.benchmarks import in_turn, prefill


def test_in_turn_reverses_every_other_round():
    runs = ["triton", "flashinfer", "cudnn"]
    assert [in_turn(runs, index) for index in range(4)] == [runs, runs[::-1], runs, runs[::-1]]
    assert runs == ["triton", "flashinfer", "cudnn"]  # the caller's list is left as it was


class _Graph:
    """A captured run's stand-in: its replay returns the column's name."""

    def __init__(self, name):
        self.name = name

    def replay(self):
        return self.name


def test_prefill_rounds_time_every_column_in_alternating_order(monkeypatch):
    """`_time_rows` times each column once a round (eager, then captured) in the order of `in_turn`, in the
    windows and in the sustained replay, keeps every round and reports the medians: fake clocks give each call
    a time that names its column and round."""
    import mla_multi.testing

    monkeypatch.setattr(mla_multi.testing, "capture_graph", lambda run: _Graph(run()))
    monkeypatch.setattr(prefill.torch.cuda, "synchronize", lambda: None)
    times = {"a": [3.0, 1.0, 2.0], "b": [5.0, 6.0, 4.0]}
    windows, steady = [], []

    def fake_bench(fn):
        if isinstance(getattr(fn, "__self__", None), _Graph):  # a captured replay
            name = fn()
            windows.append(name)
            return times[name][windows.count(name) - 1]
        return 100.0  # an eager call

    def fake_sustained(replay, seconds, sampler):
        steady.append(replay())
        return (float(len(steady)), 1500.0, 690.0)

    class Sampler:
        def stop(self):
            pass

    monkeypatch.setattr(prefill, "_bench", fake_bench)
    monkeypatch.setattr(prefill, "sustained_replay", fake_sustained)
    monkeypatch.setattr(prefill, "ClockSampler", Sampler)
    row = {"_runs": [("a", lambda: "a"), ("b", lambda: "b")], "notes": [], "ms": {}, "tflops": {}}
    prefill._time_rows(row, flops=1e9, rounds=3, sustained=0.5)
    assert windows == ["a", "b", "b", "a", "a", "b"]
    assert steady == ["a", "b", "b", "a", "a", "b"]
    assert row["ms_rounds"] == {"a": [3.0, 1.0, 2.0], "b": [5.0, 6.0, 4.0]}
    assert row["ms"] == {"a": 2.0, "b": 5.0}
    assert row["eager_ms"] == {"a": 100.0, "b": 100.0}
    assert row["tflops"]["a"] == pytest.approx(1e9 / 2.0 / 1e9)
    # the sustained figure is the median round's (ms, MHz, W): a's rounds were calls 1, 4, 5; b's 2, 3, 6
    assert row["sustained"] == {"a": (4.0, 1500.0, 690.0), "b": (3.0, 1500.0, 690.0)}
    assert row["notes"] == []
