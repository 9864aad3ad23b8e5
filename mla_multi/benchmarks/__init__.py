"""GPU benchmarks behind `mla-multi bench decode|prefill` (also runnable as bench/*.py), and the timings
the maintainer scripts in bench/ share."""


def in_turn(runs: list, index: int) -> list:
    """The order of round `index`: the columns' order, reversed every other round, so that no column always
    follows the same one (the device's clock in a window depends on what ran just before it)."""
    return runs if index % 2 == 0 else runs[::-1]


def graph_time(fn, reps: int = 20) -> float:
    """µs per call of `fn` replayed from one CUDA graph of `reps` calls (`triton.testing.do_bench` of the
    replay, median)."""
    from triton.testing import do_bench

    from mla_multi.testing import capture_graph

    fn()
    graph = capture_graph(fn, repeats=reps)
    return do_bench(graph.replay, return_mode="median") * 1000 / reps


def host_time(fn, calls: int = 300) -> float:
    """µs of host time per call of `fn` over `calls` calls in a row (after one call, with the GPU waited for
    before and after but not between: the host path alone while the GPU queue fills)."""
    import time

    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def eager_time(fn) -> float:
    """µs per plain call of `fn`, host path included (`triton.testing.do_bench`, median)."""
    from triton.testing import do_bench

    fn()
    return do_bench(fn, return_mode="median") * 1000
