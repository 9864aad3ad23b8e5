"""GPU benchmarks behind `mla-multi bench decode|prefill` (also runnable as bench/*.py)."""
