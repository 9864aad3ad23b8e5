"""Decode benchmark from a source checkout; the code lives in `mla_multi.benchmarks.decode`.

    PYTHONPATH=. python3 bench/decode.py --help   (same as `mla-multi bench decode --help`)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mla_multi.benchmarks.decode import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
