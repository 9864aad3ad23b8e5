"""Published third-party distributions for contract tests, downloaded once into pytest's cache.

The contract tests read a library's published source with `ast` and never
import it; an environment variable may point at a local copy for offline runs.
"""

import os
import pathlib
import subprocess
import sys


def published_distribution(pytestconfig, requirement: str, file_prefix: str, suffix: str, env_var: str,
                           pip_args: tuple[str, ...], pip_env: dict[str, str] | None = None) -> pathlib.Path:
    """The file of `requirement` ("name==version"): `env_var` if set, else pip-downloaded into the pytest cache."""
    given = os.environ.get(env_var)
    if given:
        path = pathlib.Path(given)
        assert path.is_file(), f"{env_var}={given!r} is not a file"
        return path
    cache = pytestconfig.cache.mkdir(f"published-{file_prefix}")
    version = requirement.partition("==")[2]
    found = sorted(cache.glob(f"{file_prefix}-{version}*{suffix}" if version else f"{file_prefix}-*{suffix}"))
    if not found:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", *pip_args, "-d", str(cache), requirement]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=dict(os.environ, **(pip_env or {})))
        assert done.returncode == 0, (
            f"could not download {requirement} ({' '.join(command)}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}\n"
            f"Set {env_var} to a downloaded copy to run offline."
        )
        found = sorted(cache.glob(f"{file_prefix}-*{suffix}"))
    assert found, f"no {file_prefix} distribution in {cache}"
    return found[-1]
