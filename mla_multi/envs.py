"""Every `MLA_MULTI_*` environment variable: name, type, default, meaning.

Values are parsed strictly when read: a value that does not parse raises
`EnvironmentValueError` naming the variable, the value and what is accepted,
instead of being ignored.  Module attributes read the environment on each
access (``mla_multi.envs.MLA_MULTI_NUM_KV_SPLITS``), so tests can monkeypatch
`os.environ`.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Callable
from typing import Any


class EnvironmentValueError(ValueError):
    """An `MLA_MULTI_*` variable holds a value that does not parse, or the name itself is unknown."""


class UnknownVariableError(EnvironmentValueError):
    """An `MLA_MULTI_*` variable that the package does not know (most often a misspelt one)."""


@dataclasses.dataclass(frozen=True)
class EnvVar:
    name: str
    default: Any
    parse: Callable[[str, str], Any]
    doc: str

    def read(self) -> Any:
        # parsed once per raw value: the hot paths read a few variables on every call
        data = getattr(os.environ, "_data", None)
        if isinstance(data, dict):
            encoded = _ENCODED_KEYS.get(self.name)
            if encoded is None:
                encoded = _ENCODED_KEYS[self.name] = _encoded(self.name)
            key = data.get(encoded)
        else:
            key = os.environ.get(self.name)
        cached = _PARSED.get(self.name)
        if cached is not None and cached[0] == key:
            return cached[1]
        raw = os.environ.get(self.name)
        if raw is None or raw.strip() == "":
            value = self.default
        else:
            value = self.parse(self.name, raw.strip())
        _PARSED[self.name] = (key, value)
        return value

    def raw(self) -> str | None:
        """The value as set in the environment (None when unset)."""
        return os.environ.get(self.name)

    def is_set(self) -> bool:
        return os.environ.get(self.name, "").strip() != ""


# name -> (the raw value as last read, its parsed value)
_PARSED: dict[str, tuple[Any, Any]] = {}
# name -> its key in CPython's encoded copy of the environment (encoding a name costs a microsecond a read)
_ENCODED_KEYS: dict[str, Any] = {}


def _encoded(name: str):
    try:
        return os.environ.encodekey(name)
    except Exception:  # noqa: BLE001 - an os.environ without CPython's encoding
        return name


def _backend_name(name: str, raw: str) -> str:
    # The registry checks the name against the registered backends at import,
    # naming the variable (`registry.check_forced_names`); here only the
    # spelling is normalised so "triton" and "TRITON" mean the same.
    return raw.upper()


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw, 10)
    except ValueError:
        value = 0
    if value < 1 or value > 1024 or str(value) != raw.lstrip("+"):
        raise EnvironmentValueError(
            f"{name}={raw!r} is not accepted; expected an integer in [1, 1024]"
        )
    return value


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(name: str, raw: str) -> str:
    level = raw.upper()
    if level not in _LOG_LEVELS:
        raise EnvironmentValueError(
            f"{name}={raw!r} is not accepted; expected one of {', '.join(_LOG_LEVELS)}"
        )
    return level


def _flag(name: str, raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise EnvironmentValueError(
        f"{name}={raw!r} is not accepted; expected one of 1, 0, true, false, yes, no, on, off"
    )


ENV_VARS: dict[str, EnvVar] = {
    var.name: var
    for var in (
        EnvVar(
            "MLA_MULTI_PREFILL_BACKEND",
            None,
            _backend_name,
            "Force the prefill backend by name (TRITON, ROCM_AITER, CUDA_FLASH_ATTN, FLASHINFER, REFERENCE; "
            "`mla-multi info` lists them). The name is checked at import; a forced backend that cannot run a "
            "configuration raises with its reasons where that configuration is selected; it never falls back.",
        ),
        EnvVar(
            "MLA_MULTI_DECODE_BACKEND",
            None,
            _backend_name,
            "Force the decode backend by name, with the same rules as MLA_MULTI_PREFILL_BACKEND.",
        ),
        EnvVar(
            "MLA_MULTI_SPARSE_DECODE_BACKEND",
            None,
            _backend_name,
            "Force the sparse decode backend (mm.ops.mla_sparse_decode) by name, with the same rules as "
            "MLA_MULTI_PREFILL_BACKEND.",
        ),
        EnvVar(
            "MLA_MULTI_SPARSE_PREFILL_BACKEND",
            None,
            _backend_name,
            "Force the sparse prefill backend (mm.ops.mla_sparse_prefill) by name, with the same rules as "
            "MLA_MULTI_PREFILL_BACKEND.",
        ),
        EnvVar(
            "MLA_MULTI_NUM_KV_SPLITS",
            None,
            _positive_int,
            "Fix the number of KV splits of split-KV decode (1..1024) instead of the compute-unit "
            "heuristic; still clamped to the splits reserved in the workspace.",
        ),
        EnvVar(
            "MLA_MULTI_FP8_QK",
            True,
            _flag,
            "FP8 KV caches on sm_90 (warpgroup decode kernels): compute QK on the FP8 tensor cores from the "
            "cache's bytes, with the query quantised per row to e4m3, and up to 16 query rows P V as well with P "
            "in e4m3 (faster; measured against float64 on the dequantised cache: output relative error up to "
            "2.6e-2, within 4e-2 with the e4m3 P; LSE absolute error up to 0.08). 0: float16 products on the tile "
            "converted once per element (the bf16 path's accuracy, 1.7e-3).",
        ),
        EnvVar(
            "MLA_MULTI_PDL",
            True,
            _flag,
            "NVIDIA sm_90 and later: launch the decode kernels (a split-KV kernel filling at most half the device "
            "and its reduce, the sparse index lists' kernels) by programmatic dependent launch, each let onto the device while the kernel before "
            "it finishes and waiting on it before it touches a tensor (the gap between launches overlapped; also "
            "inside CUDA graphs). 0: each kernel starts after the previous one ends.",
        ),
        EnvVar(
            "MLA_MULTI_LOG_LEVEL",
            "WARNING",
            _log_level,
            "Level of the 'mla_multi' logger: DEBUG, INFO, WARNING, ERROR or CRITICAL.",
        ),
        EnvVar(
            "MLA_MULTI_CHECK_INPUTS",
            False,
            _flag,
            "Also run, on GPU tensors, the input checks that read tensor data (block-table entries inside the "
            "cache, seq_lens within the block table, slots inside the cache, cumulative lengths); they "
            "synchronise the device. On CPU tensors they always run. Without them the kernels stay inside "
            "their tensors and record bad indices for mm.ops.raise_pending_errors().",
        ),
    )
}


# Variables of the project's tests and CI, never read by the package itself: declared here so that
# the import's check of names accepts them (and so that they are documented in one place).
TOOLING_VARIABLES: dict[str, str] = {
    "MLA_MULTI_CI_PLATFORM": "CI runner kind (cpu, cuda, rocm): tests/test_ci_expected_backends.py checks the "
                             "backends that runner must select (set by .ci/run and ci/run-tests.sh).",
    "MLA_MULTI_AITER_WHEEL": "A local amd-aiter wheel for the aiter contract tests (offline runs).",
    "MLA_MULTI_AITER_SOURCE": "A local aiter checkout whose source the aiter contract tests read beside "
                              "tests/fake_aiter/contract.json.",
    "MLA_MULTI_AITER_SPEC": "The amd-aiter requirement the contract tests download (default pinned in the test).",
    "MLA_MULTI_FLASH_ATTN_SDIST": "A local flash-attn sdist for the flash-attn contract tests (offline runs).",
    "MLA_MULTI_FLASH_ATTN_SPEC": "The flash-attn requirement the contract tests download (default pinned in the test).",
    "MLA_MULTI_FLASHINFER_WHEEL": "A local flashinfer-python wheel for the FlashInfer contract tests (offline runs).",
    "MLA_MULTI_FLASHMLA_WHEEL": "A local sgl-flash-mla wheel for the FlashMLA contract tests (offline runs).",
}

PREFIX = "MLA_MULTI_"

_NAMES = tuple(ENV_VARS)
try:
    _ENCODED_NAMES: tuple | None = tuple(os.environ.encodekey(name) for name in _NAMES)
except Exception:  # an os.environ without CPython's encoding: use the mapping
    _ENCODED_NAMES = None


def __getattr__(name: str) -> Any:
    if name in ENV_VARS:
        return ENV_VARS[name].read()
    raise AttributeError(f"module 'mla_multi.envs' has no attribute {name!r}")


def snapshot() -> tuple:
    """The raw values of every variable, cheaply: a key under which decisions made from them can be cached.

    Reads CPython's encoded copy of the environment (``os.environ._data``, which ``os.environ`` updates on
    every change) where it exists: 0.3 µs instead of 5 µs through the mapping's per-key encoding.
    """
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict) and _ENCODED_NAMES is not None:
        return tuple(map(data.get, _ENCODED_NAMES))
    return tuple(map(os.environ.get, _NAMES))


def known_names() -> tuple[str, ...]:
    """Every `MLA_MULTI_*` name the package accepts in the environment: its own and its tests' and CI's."""
    return (*ENV_VARS, *TOOLING_VARIABLES)


def unknown_names(environ=None) -> list[str]:
    """The `MLA_MULTI_*` names set in `environ` (default: the process's) that the package does not know."""
    environ = os.environ if environ is None else environ
    known = set(known_names())
    return sorted(name for name in environ if name.startswith(PREFIX) and name not in known)


def check_names(environ=None) -> None:
    """Raise `UnknownVariableError` for the first unknown `MLA_MULTI_*` name, with the closest known one."""
    unknown = unknown_names(environ)
    if not unknown:
        return
    name = unknown[0]
    close = difflib.get_close_matches(name, known_names(), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(ENV_VARS)}"
    others = f" (also unknown: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
    raise UnknownVariableError(f"{name} is not a variable of mla_multi; {hint}{others}")


def validate_all() -> dict[str, Any]:
    """Check every `MLA_MULTI_*` name and parse every variable now; raises `EnvironmentValueError` on the first bad one."""
    check_names()
    return {name: var.read() for name, var in ENV_VARS.items()}


def overrides_in_force() -> dict[str, str]:
    """The `MLA_MULTI_*` variables that are set, as raw strings (for `mla-multi info`)."""
    return {name: os.environ[name] for name, var in ENV_VARS.items() if var.is_set()}


def configure_logging() -> logging.Logger:
    logger = logging.getLogger("mla_multi")
    logger.setLevel(ENV_VARS["MLA_MULTI_LOG_LEVEL"].read())
    return logger
