"""GPU benchmarks behind `mla-multi bench decode|prefill` (also runnable as bench/*.py), and the timings
the maintainer scripts in bench/ share."""

import sys


def needs_gpu(command: str, needed: int = 1, hint: str = "") -> int:
    """The one message for a command that cannot run without GPUs; returns the exit status (2).

    Every benchmark that needs a device says it in these words, whether run as `mla-multi bench ...`
    or as a script.
    """
    try:
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken probe counts as no device
        found = 0
    what = "a CUDA or ROCm GPU" if needed == 1 else f"{needed} CUDA or ROCm GPUs"
    print(f"{command}: error: needs {what}; torch sees {found}" + (f" ({hint})" if hint else ""), file=sys.stderr)
    return 2


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


def best_host_time(fn, batches: int = 40, calls: int = 10) -> float:
    """µs of host time per call of `fn`: the best of `batches` batches of `calls` calls in a row (the GPU
    waited for before each batch; a noisy host's spikes left out), after 20 calls of warm-up."""
    import time

    import torch

    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


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
