"""Prefill benchmark from a source checkout; the code lives in `mla_multi.benchmarks.prefill`.

    PYTHONPATH=. python3 -m bench.prefill --help   (same as `mla-multi bench prefill --help`)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mla_multi.benchmarks.prefill import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
