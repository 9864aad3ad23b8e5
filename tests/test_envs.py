"""Every MLA_MULTI_* variable: strict parsing, defaults, reporting, and failing the import on a bad value."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mla_multi import envs
from mla_multi.envs import ENV_VARS, EnvironmentValueError

ALL_NAMES = (
    "MLA_MULTI_PREFILL_BACKEND",
    "MLA_MULTI_DECODE_BACKEND",
    "MLA_MULTI_SPARSE_DECODE_BACKEND",
    "MLA_MULTI_SPARSE_PREFILL_BACKEND",
    "MLA_MULTI_NUM_KV_SPLITS",
    "MLA_MULTI_LOG_LEVEL",
    "MLA_MULTI_CHECK_INPUTS",
    "MLA_MULTI_FP8_QK",
    "MLA_MULTI_PDL",
)
DEFAULTS = {
    "MLA_MULTI_PREFILL_BACKEND": None,
    "MLA_MULTI_DECODE_BACKEND": None,
    "MLA_MULTI_SPARSE_DECODE_BACKEND": None,
    "MLA_MULTI_SPARSE_PREFILL_BACKEND": None,
    "MLA_MULTI_NUM_KV_SPLITS": None,
    "MLA_MULTI_LOG_LEVEL": "WARNING",
    "MLA_MULTI_CHECK_INPUTS": False,
    "MLA_MULTI_FP8_QK": True,
    "MLA_MULTI_PDL": True,
}
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch):
    """No MLA_MULTI_* variable set (the suite's own settings are restored afterwards)."""
    for name in list(os.environ):
        if name.startswith("MLA_MULTI_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_every_variable_is_declared_with_a_doc():
    assert set(ENV_VARS) == set(ALL_NAMES)
    for name, var in ENV_VARS.items():
        assert var.name == name
        assert name.startswith("MLA_MULTI_")
        assert len(var.doc) > 20


@pytest.mark.parametrize("name", ALL_NAMES)
def test_defaults_when_unset(clean_env, name):
    assert getattr(envs, name) == DEFAULTS[name]


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("blank", ["", "   "])
def test_blank_means_default(clean_env, name, blank):
    clean_env.setenv(name, blank)
    assert getattr(envs, name) == DEFAULTS[name]
    assert name not in envs.overrides_in_force()


@pytest.mark.parametrize("name", ["MLA_MULTI_PREFILL_BACKEND", "MLA_MULTI_DECODE_BACKEND"])
@pytest.mark.parametrize("raw, parsed", [("triton", "TRITON"), ("REFERENCE", "REFERENCE"),
                                         ("  rocm_aiter ", "ROCM_AITER"), ("Cuda_Flash_Attn", "CUDA_FLASH_ATTN")])
def test_backend_names_are_normalised(clean_env, name, raw, parsed):
    clean_env.setenv(name, raw)
    assert getattr(envs, name) == parsed


@pytest.mark.parametrize("raw, parsed", [("1", 1), ("16", 16), ("1024", 1024), (" 7 ", 7), ("+8", 8)])
def test_num_kv_splits_good(clean_env, raw, parsed):
    clean_env.setenv("MLA_MULTI_NUM_KV_SPLITS", raw)
    value = envs.MLA_MULTI_NUM_KV_SPLITS
    assert value == parsed and isinstance(value, int)


@pytest.mark.parametrize("raw", ["0", "-1", "1025", "abc", "1.5", "08", "0x10", "1_000", "16k", "1e3"])
def test_num_kv_splits_bad(clean_env, raw):
    clean_env.setenv("MLA_MULTI_NUM_KV_SPLITS", raw)
    with pytest.raises(EnvironmentValueError) as info:
        envs.MLA_MULTI_NUM_KV_SPLITS
    message = str(info.value)
    assert "MLA_MULTI_NUM_KV_SPLITS" in message
    assert repr(raw) in message
    assert "[1, 1024]" in message


@pytest.mark.parametrize("raw, parsed", [("debug", "DEBUG"), ("INFO", "INFO"), ("Warning", "WARNING"),
                                         ("error", "ERROR"), ("critical", "CRITICAL")])
def test_log_level_good(clean_env, raw, parsed):
    clean_env.setenv("MLA_MULTI_LOG_LEVEL", raw)
    assert envs.MLA_MULTI_LOG_LEVEL == parsed


@pytest.mark.parametrize("raw", ["verbose", "10", "warn", "TRACE"])
def test_log_level_bad(clean_env, raw):
    clean_env.setenv("MLA_MULTI_LOG_LEVEL", raw)
    with pytest.raises(EnvironmentValueError) as info:
        envs.MLA_MULTI_LOG_LEVEL
    message = str(info.value)
    assert "MLA_MULTI_LOG_LEVEL" in message and repr(raw) in message
    for level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        assert level in message


@pytest.mark.parametrize("raw, parsed", [("1", True), ("true", True), ("YES", True), ("On", True),
                                         ("0", False), ("False", False), ("no", False), ("OFF", False)])
def test_check_inputs_good(clean_env, raw, parsed):
    clean_env.setenv("MLA_MULTI_CHECK_INPUTS", raw)
    assert envs.MLA_MULTI_CHECK_INPUTS is parsed


@pytest.mark.parametrize("raw", ["2", "maybe", "y", "enabled", "-1"])
def test_check_inputs_bad(clean_env, raw):
    clean_env.setenv("MLA_MULTI_CHECK_INPUTS", raw)
    with pytest.raises(EnvironmentValueError) as info:
        envs.MLA_MULTI_CHECK_INPUTS
    message = str(info.value)
    assert "MLA_MULTI_CHECK_INPUTS" in message and repr(raw) in message
    assert "true" in message and "false" in message


def test_environment_value_error_is_a_value_error():
    assert issubclass(EnvironmentValueError, ValueError)


def test_unknown_attribute_raises_attribute_error():
    with pytest.raises(AttributeError, match="MLA_MULTI_NOT_A_VARIABLE"):
        envs.MLA_MULTI_NOT_A_VARIABLE  # noqa: B018


def test_values_are_read_on_each_access(clean_env):
    clean_env.setenv("MLA_MULTI_NUM_KV_SPLITS", "4")
    assert envs.MLA_MULTI_NUM_KV_SPLITS == 4
    clean_env.setenv("MLA_MULTI_NUM_KV_SPLITS", "32")
    assert envs.MLA_MULTI_NUM_KV_SPLITS == 32
    clean_env.delenv("MLA_MULTI_NUM_KV_SPLITS")
    assert envs.MLA_MULTI_NUM_KV_SPLITS is None


def test_validate_all(clean_env):
    assert envs.validate_all() == DEFAULTS
    clean_env.setenv("MLA_MULTI_DECODE_BACKEND", "reference")
    clean_env.setenv("MLA_MULTI_NUM_KV_SPLITS", "8")
    assert envs.validate_all() == {**DEFAULTS, "MLA_MULTI_DECODE_BACKEND": "REFERENCE", "MLA_MULTI_NUM_KV_SPLITS": 8}
    clean_env.setenv("MLA_MULTI_LOG_LEVEL", "chatty")
    with pytest.raises(EnvironmentValueError, match="MLA_MULTI_LOG_LEVEL"):
        envs.validate_all()


def test_overrides_in_force(clean_env):
    assert envs.overrides_in_force() == {}
    clean_env.setenv("MLA_MULTI_NUM_KV_SPLITS", "8")
    clean_env.setenv("MLA_MULTI_PREFILL_BACKEND", "triton")
    clean_env.setenv("MLA_MULTI_DECODE_BACKEND", "")
    clean_env.setenv("MLA_MULTI_UNRELATED", "x")  # not a declared variable
    # Raw strings, only the declared and non-blank ones.
    assert envs.overrides_in_force() == {"MLA_MULTI_NUM_KV_SPLITS": "8", "MLA_MULTI_PREFILL_BACKEND": "triton"}


def test_configure_logging_sets_the_level(clean_env):
    logger = logging.getLogger("mla_multi")
    previous = logger.level
    try:
        clean_env.setenv("MLA_MULTI_LOG_LEVEL", "debug")
        assert envs.configure_logging() is logger
        assert logger.level == logging.DEBUG
        clean_env.setenv("MLA_MULTI_LOG_LEVEL", "error")
        envs.configure_logging()
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(previous)


# --------------------------------------------------------------------------- the import fails on bad values


def start_import(env_updates: dict[str, str], code: str = "import mla_multi", extra_path: Path | None = None):
    """Start `python -c code` with only the given MLA_MULTI_* variables set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_MULTI_")}
    env.update(env_updates)
    # Keep the subprocess on the CPU whatever the test machine has, so the checks are the same everywhere.
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["HIP_VISIBLE_DEVICES"] = ""
    paths = [str(REPO_ROOT)] + ([str(extra_path)] if extra_path else []) + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# A backend that only runs on ROCm, added to the package's decode table while the package imports
# (before the import-time selection), so that forcing it on this CPU machine must fail the import.
ROCM_ONLY_MODULE = '''
from mla_multi.backends.base import MLADecodeBackend
from mla_multi.backends.reference import ReferenceDecodeImpl


class RocmOnlyDecodeBackend(MLADecodeBackend):
    name = "ROCM_ONLY"
    vendors = frozenset({"rocm"})

    @staticmethod
    def get_decode_impl_cls():
        return ReferenceDecodeImpl
'''

ADD_BACKEND_AND_IMPORT = textwrap.dedent(
    '''
    import importlib.abc, importlib.util, sys

    class AddBackend(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != "mla_multi.registry":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            exec_module = spec.loader.exec_module

            def exec_and_register(module):
                exec_module(module)
                module.DECODE_BACKENDS["ROCM_ONLY"] = "rocm_only_backend:RocmOnlyDecodeBackend"

            spec.loader.exec_module = exec_and_register
            return spec

    sys.meta_path.insert(0, AddBackend())
    import mla_multi
    print(mla_multi.registry.names("decode"), "import_selection_errors:", sorted(mla_multi.import_selection_errors()))
    print(mla_multi.selected_backends()["decode"])
    '''
)


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """Every import scenario, run in parallel subprocesses: name -> CompletedProcess-like (returncode, stdout, stderr)."""
    module_dir = tmp_path_factory.mktemp("rocm_only")
    (module_dir / "rocm_only_backend.py").write_text(ROCM_ONLY_MODULE)
    scenarios = {
        "good": ({"MLA_MULTI_NUM_KV_SPLITS": "8", "MLA_MULTI_DECODE_BACKEND": "reference", "MLA_MULTI_CHECK_INPUTS": "1"},
                 "import mla_multi; print(mla_multi.selected_backends()['decode'])", None),
        "bad_splits": ({"MLA_MULTI_NUM_KV_SPLITS": "lots"}, "import mla_multi", None),
        "unknown_decode": ({"MLA_MULTI_DECODE_BACKEND": "no_such_backend"}, "import mla_multi", None),
        "unknown_prefill": ({"MLA_MULTI_PREFILL_BACKEND": "no_such_backend"}, "import mla_multi", None),
        "registered": ({}, ADD_BACKEND_AND_IMPORT, module_dir),
        "forced_misfit": ({"MLA_MULTI_DECODE_BACKEND": "rocm_only"}, ADD_BACKEND_AND_IMPORT, module_dir),
        "misspelt_name": ({"MLA_MULTI_DECODE_BACKEN": "TRITON"}, "import mla_multi", None),
        "unknown_name": ({"MLA_MULTI_LOGLEVEL": "DEBUG"}, "import mla_multi", None),
        "tooling_names": ({name: "x" for name in envs.TOOLING_VARIABLES}, "import mla_multi", None),
        "misspelt_backend": ({"MLA_MULTI_DECODE_BACKEND": "TRITN"}, "import mla_multi", None),
        "interpreter_forced": ({"MLA_MULTI_DECODE_BACKEND": "TRITON", "MLA_MULTI_PREFILL_BACKEND": "TRITON",
                                "TRITON_INTERPRET": "1"},
                               "import mla_multi; print(sorted(mla_multi.import_selection_errors()))", None),
    }
    processes = {name: start_import(*scenario) for name, scenario in scenarios.items()}
    results = {}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=180)
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return results


def test_import_succeeds_with_good_values(imports):
    result = imports["good"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "REFERENCE"


def test_import_fails_on_bad_num_kv_splits(imports):
    result = imports["bad_splits"]
    assert result.returncode != 0
    assert "EnvironmentValueError" in result.stderr
    assert "MLA_MULTI_NUM_KV_SPLITS='lots'" in result.stderr
    assert "[1, 1024]" in result.stderr


@pytest.mark.parametrize("scenario, phase", [("unknown_decode", "decode"), ("unknown_prefill", "prefill")])
def test_import_fails_on_unknown_backend_name(imports, scenario, phase):
    result = imports[scenario]
    assert result.returncode != 0
    assert "UnknownBackendError" in result.stderr
    assert f"unknown {phase} backend 'NO_SUCH_BACKEND'" in result.stderr
    # The valid names are listed.
    assert "valid names:" in result.stderr and "REFERENCE" in result.stderr


def test_a_forced_backend_that_does_not_fit_fails_the_first_selection_not_the_import(imports):
    # Control: registered but not forced, the import succeeds and the name is known.
    result = imports["registered"]
    assert result.returncode == 0, result.stderr
    assert "ROCM_ONLY" in result.stdout
    result = imports["forced_misfit"]
    # The import itself succeeded (the names were printed) and recorded the failure with its reasons ...
    assert "ROCM_ONLY" in result.stdout and "import_selection_errors: ['decode']" in result.stdout, result.stderr
    # ... and the first selection that uses it, selected_backends(), raises it.
    assert result.returncode != 0
    assert "NoBackendError" in result.stderr
    assert "The forced decode backend ROCM_ONLY cannot run this configuration" in result.stderr
    assert "supported vendors: rocm" in result.stderr
    # The configuration the import selects for is printed with the reasons.
    assert "num_heads=128" in result.stderr and "dtype=bfloat16" in result.stderr


def test_snapshot_follows_the_environment(monkeypatch):
    monkeypatch.delenv("MLA_MULTI_NUM_KV_SPLITS", raising=False)
    before = envs.snapshot()
    monkeypatch.setenv("MLA_MULTI_NUM_KV_SPLITS", "4")
    during = envs.snapshot()
    assert during != before and envs.MLA_MULTI_NUM_KV_SPLITS == 4
    monkeypatch.setenv("MLA_MULTI_NUM_KV_SPLITS", "8")
    assert envs.snapshot() != during and envs.MLA_MULTI_NUM_KV_SPLITS == 8  # parsed again for a new value
    monkeypatch.delenv("MLA_MULTI_NUM_KV_SPLITS")
    assert envs.snapshot() == before and envs.MLA_MULTI_NUM_KV_SPLITS is None


# --------------------------------------------------------------------------- strict names, forced names at import


def test_a_misspelt_variable_fails_the_import_with_the_closest_name(imports):
    result = imports["misspelt_name"]
    assert result.returncode != 0
    assert "UnknownVariableError: MLA_MULTI_DECODE_BACKEN is not a variable of mla_multi; " \
           "did you mean MLA_MULTI_DECODE_BACKEND?" in result.stderr
    result = imports["unknown_name"]
    assert result.returncode != 0
    assert "MLA_MULTI_LOGLEVEL is not a variable of mla_multi; did you mean MLA_MULTI_LOG_LEVEL?" in result.stderr


def test_the_tests_and_ci_variables_are_known(imports):
    result = imports["tooling_names"]
    assert result.returncode == 0, result.stderr


def test_every_mla_multi_name_in_the_repository_is_declared():
    """tests/, ci/, .ci/, bench/ and .github/ may only use names envs.py declares (the import rejects others)."""
    import re

    used: dict[str, str] = {}
    for folder in ("tests", "ci", ".ci", "bench", ".github", "mla_multi"):
        for path in (REPO_ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in ("", ".py", ".sh", ".yml", ".yaml", ".json", ".md"):
                for name in re.findall(r"\bMLA_MULTI_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")):
                    used.setdefault(name, str(path.relative_to(REPO_ROOT)))
    # Names that are not environment variables: a module constant, and the deliberately unknown ones of this file.
    not_variables = {"MLA_MULTI_TOKEN_HEADS_DIVIDE", "MLA_MULTI_NOT_A_VARIABLE", "MLA_MULTI_UNRELATED",
                     "MLA_MULTI_DECODE_BACKEN", "MLA_MULTI_LOGLEVEL", "MLA_MULTI_NUM_KV_SPLIT",
                     "MLA_MULTI_ZZZZZZZZZZZZZZ"}
    undeclared = {name: where for name, where in used.items()
                  if name not in envs.known_names() and name not in not_variables}
    assert not undeclared, f"used but not declared in mla_multi/envs.py: {undeclared}"


def test_unknown_names_and_check_names(clean_env):
    assert envs.unknown_names() == []
    envs.check_names()
    clean_env.setenv("MLA_MULTI_NUM_KV_SPLIT", "4")
    assert envs.unknown_names() == ["MLA_MULTI_NUM_KV_SPLIT"]
    with pytest.raises(envs.UnknownVariableError, match="did you mean MLA_MULTI_NUM_KV_SPLITS"):
        envs.check_names()
    with pytest.raises(EnvironmentValueError, match="MLA_MULTI_NUM_KV_SPLIT is not a variable"):
        envs.validate_all()
    clean_env.setenv("MLA_MULTI_ZZZZZZZZZZZZZZ", "1")
    with pytest.raises(envs.UnknownVariableError, match="also unknown: MLA_MULTI_ZZZZZZZZZZZZZZ"):
        envs.check_names()


def test_a_misspelt_backend_name_names_its_variable(imports):
    result = imports["misspelt_backend"]
    assert result.returncode != 0
    assert "MLA_MULTI_DECODE_BACKEND='TRITN': unknown decode backend 'TRITN'" in result.stderr
    assert "did you mean TRITON?" in result.stderr


def test_forcing_triton_under_the_interpreter_keeps_the_import(imports):
    # TRITON under the interpreter takes no bfloat16, the dtype of the import-time defaults: the import
    # records that and succeeds; a configuration it can run (float16) selects it.
    result = imports["interpreter_forced"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['decode', 'prefill']"
