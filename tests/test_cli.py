"""The CLI: info (text, JSON, impersonated), demo, and option pass-through of compile-check and bench."""

import json
import subprocess
import sys

import pytest

from mla_multi import cli


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mla_multi", *args], capture_output=True, text=True, timeout=600, env=env)


def test_info_json_on_impersonated_mi300x_lists_every_backend_with_reasons():
    info = cli.collect_info("MI300X")
    assert info["platform"]["arch"] == "gfx942" and info["impersonated"]
    decode = info["phases"]["decode"]
    assert decode["priority"][0] == "ROCM_AITER"
    names = {row["name"] for row in decode["backends"]}
    assert {"ROCM_AITER", "TRITON", "CUDA_FLASH_ATTN", "REFERENCE"} <= names
    selected = [row["name"] for row in decode["backends"] if row["selected"]]
    assert selected == [decode["selected"]]
    for row in decode["backends"]:
        assert row["available"] == (not row["reasons"])


def test_info_text_and_json_commands():
    text = run_cli("info", "--as", "H100")
    assert text.returncode == 0, text.stderr
    assert "platform (impersonated): H100" in text.stdout and "decode: selected" in text.stdout
    as_json = run_cli("info", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert set(json.loads(as_json.stdout)["phases"]) == {"prefill", "decode", "sparse_decode", "sparse_prefill",
                                                         "sparse_decode_v4", "sparse_prefill_v4"}
    assert "sparse_decode: selected" in text.stdout and "fp8_ds_mla" in text.stdout


def test_info_unknown_spec_is_an_error():
    with pytest.raises(ValueError, match="unknown platform spec 'MI999'"):
        cli.collect_info("MI999")


def test_compile_check_options_reach_the_checker(monkeypatch):
    seen = {}
    monkeypatch.setattr("mla_multi.compile_check.main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert cli.main(["compile-check", "--targets", "gfx942,gfx950", "--kernels", "merge"]) == 0
    assert seen["argv"] == ["--targets", "gfx942,gfx950", "--kernels", "merge"]


def test_bench_options_reach_the_benchmark(monkeypatch):
    seen = {}
    monkeypatch.setattr("mla_multi.benchmarks.decode.main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert cli.main(["bench", "decode", "--heads", "16", "--cases", "1x4096"]) == 0
    assert seen["argv"] == ["--heads", "16", "--cases", "1x4096"]


def test_bench_dcp_options_reach_the_benchmark(monkeypatch):
    seen = {}
    monkeypatch.setattr("mla_multi.benchmarks.dcp.main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert cli.main(["bench", "dcp", "--cases", "8x32768", "--world-sizes", "1,2"]) == 0
    assert seen["argv"] == ["--cases", "8x32768", "--world-sizes", "1,2"]


def test_demo_on_the_cpu_checks_against_naive_mla():
    done = run_cli("demo", "--num-heads", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "backends: prefill=REFERENCE decode=REFERENCE" in done.stdout
    assert "OK" in done.stdout.splitlines()[-1]


def test_sparse_demo_on_the_cpu_checks_against_naive_sparse_mla():
    done = run_cli("demo", "--sparse", "--num-heads", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fp8_ds_mla cache" in done.stdout and "sparse_decode=REFERENCE" in done.stdout
    assert "OK" in done.stdout.splitlines()[-1]


def test_warmup_runs_every_path_of_a_layer_configuration(capsys):
    from mla_multi import cli

    assert cli.main(["warmup", "--num-heads", "2", "--block-size", "16", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "warmup on CPU: 2 heads" in out and "kv cache torch.float8_e4m3fn" in out
    for step in ("prefill:", "decode + prefill:", "decode + prefill over chunked context:"):
        assert step in out, out


def test_info_names_the_triton_decode_kernels_and_why_not_the_warpgroup_ones():
    from mla_multi.cli import collect_info
    from mla_multi.kernels.mla_decode_wgmma import gluon_available

    a100 = collect_info("A100")["triton_decode"]
    assert "sm_90" in a100["warpgroup_kernels"] and "sm_80" in a100["warpgroup_kernels"]
    assert all("Triton kernel" in kernel for kernel in a100["kernels"].values())
    h200 = collect_info("H200")["triton_decode"]
    if gluon_available()[0]:
        assert h200["warpgroup_kernels"] == "available"
        assert "warpgroup" in h200["kernels"]["bfloat16, 128 heads"]
        assert "Triton kernel" in h200["kernels"]["bfloat16, 16 heads"]
    else:
        assert "Gluon" in h200["warpgroup_kernels"]


def test_info_names_the_triton_prefill_kernel_and_why_not_the_sm90_one():
    from mla_multi.cli import collect_info
    from mla_multi.kernels.mla_decode_wgmma import gluon_available

    for spec in ("A100", "MI300X", "B200"):
        found = collect_info(spec)["triton_prefill"]
        assert "Triton kernel" in found["kernel"] and "sm_90" in found["sm90_kernel"], (spec, found)
        assert ("ordered for 8 XCDs" in found["kernel"]) == (spec == "MI300X"), (spec, found)
    h100 = collect_info("H100")["triton_prefill"]
    if gluon_available()[0]:
        assert h100["sm90_kernel"] == "available" and "prefill_wgmma" in h100["kernel"], h100
    else:
        assert "Gluon" in h100["sm90_kernel"], h100


def test_info_names_the_sparse_decode_backend_of_a_one_token_call(monkeypatch):
    """`mla-multi info` shows where a planned sparse decode call of one token goes by a rule (sm_90, the
    in-place loader available), and nothing where no rule applies (an MI300X; sm_90 without the loader)."""
    from mla_multi import registry
    from mla_multi.kernels import mla_decode

    monkeypatch.setattr(mla_decode, "ds_mla_decode_reason", lambda platform, kv_cache=None: "")
    registry.default_registry.clear_cache()
    one = cli.collect_info("H200")["phases"]["sparse_decode"]["one_token"]
    assert one["selected"] == "TRITON" and "nvidia-sm90-sparse-decode-few-tokens" in one["rule"]
    assert cli.collect_info("MI300X")["phases"]["sparse_decode"]["one_token"] is None
    monkeypatch.setattr(mla_decode, "ds_mla_decode_reason", lambda platform, kv_cache=None: "no loader")
    registry.default_registry.clear_cache()
    assert cli.collect_info("H200")["phases"]["sparse_decode"]["one_token"] is None
    registry.default_registry.clear_cache()


def test_prefill_bench_reports_the_sustained_replay_beside_its_peers():
    from mla_multi.benchmarks import prefill

    row = {"num_heads": 128, "batch": 1, "seqlen": 8192, "causal": True, "notes": [],
           "tflops": {"triton": 600.0, "flashinfer": 640.0, "cudnn": 550.0},
           "eager_ms": {"triton": 4.5, "flashinfer": 4.3, "cudnn": 5.0},
           "sustained": {"triton": (4.4, 1470.0, 692.0), "flashinfer": (4.3, 1490.0, 691.0)}}
    table = prefill.format_table([row])
    line = [text for text in table.splitlines() if text.startswith("| 128 |")][-1]
    assert "4400.0 (1470, 692)" in line and "4300.0 (1490, 691)" in line
    assert "| 0.977 |" in line and line.rstrip().endswith("| nan |")  # no cuDNN in the sustained runs
    del row["sustained"]
    assert "Sustained replay" not in prefill.format_table([row])


def test_clock_sampler_averages_only_the_samples_of_its_window():
    from mla_multi.benchmarks.prefill import ClockSampler

    sampler = ClockSampler.__new__(ClockSampler)
    sampler.samples = [(1.0, 1000.0, 500.0), (2.0, 1400.0, 600.0), (3.0, 1600.0, 700.0), (9.0, 1980.0, 100.0)]
    assert sampler.means(1.5, 3.5) == (1500.0, 650.0)
    mhz, watts = sampler.means(4.0, 5.0)
    assert mhz != mhz and watts != watts  # no sample: NaN


def test_sparse_bench_rejects_rounds_below_one(capsys):
    from mla_multi.benchmarks import sparse

    for phase in ("sparse_decode", "sparse_prefill"):
        with pytest.raises(SystemExit) as raised:
            sparse.main(["--rounds", "0"], phase=phase)
        assert raised.value.code == 2
        assert "--rounds 0; accepted: 1 or more" in capsys.readouterr().err


# --------------------------------------------------------------------------- a user's mistakes: one line, status 2

MISTAKES = {
    # name: (extra environment, arguments, the words of the one line)
    "unknown_spec": ({}, ["info", "--as", "NOTADEVICE"],
                     "mla-multi info: error: unknown platform spec 'NOTADEVICE'; accepted: a device name"),
    "bad_log_level": ({"MLA_MULTI_LOG_LEVEL": "DEBG"}, ["--help"],
                      "mla-multi: error: MLA_MULTI_LOG_LEVEL='DEBG' is not accepted; expected one of DEBUG"),
    "misspelt_variable": ({"MLA_MULTI_DECODE_BACKEN": "TRITON"}, ["info"],
                          "mla-multi: error: MLA_MULTI_DECODE_BACKEN is not a variable of mla_multi; "
                          "did you mean MLA_MULTI_DECODE_BACKEND?"),
    "misspelt_backend": ({"MLA_MULTI_DECODE_BACKEND": "TRITN"}, ["info"],
                         "mla-multi: error: MLA_MULTI_DECODE_BACKEND='TRITN': unknown decode backend 'TRITN'"),
    "bad_head_count": ({}, ["demo", "--num-heads", "0"],
                       "mla-multi demo: error: argument --num-heads: '0'; accepted: an integer of 1 or more"),
    "unknown_phase": ({}, ["bench", "nope"], "mla-multi bench: error: argument PHASE: invalid choice: 'nope'"),
    "unknown_target": ({}, ["compile-check", "--targets", "sm_1"], "mla-multi compile-check: error: "),
}
FINE = {
    "version": ({}, ["--version"]),
    "bench_help": ({}, ["bench", "--help"]),
    "bench_decode_help": ({}, ["bench", "decode", "--help"]),
    "layer_help": ({}, ["bench", "layer", "--help"]),
    "forced_help": ({"MLA_MULTI_DECODE_BACKEND": "TRITON", "TRITON_INTERPRET": "1"}, ["--help"]),
    "forced_info": ({"MLA_MULTI_DECODE_BACKEND": "TRITON", "TRITON_INTERPRET": "1"}, ["info"]),
    "info_a100": ({}, ["info", "--as", "A100"]),
}


@pytest.fixture(scope="module")
def commands():
    """Every command of this section, run in parallel: name -> CompletedProcess."""
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("MLA_MULTI_")}
    base.update(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    started = {}
    for name, (env, args, *_) in {**MISTAKES, **FINE}.items():
        started[name] = subprocess.Popen([sys.executable, "-m", "mla_multi", *args], env={**base, **env},
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=600)
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return results


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_users_mistake_is_one_line_with_status_2(commands, name):
    done = commands[name]
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    # argparse's own errors print the usage above the line; the line itself is the last one
    assert lines and lines[-1].startswith(MISTAKES[name][2]), done.stderr
    if not lines[0].startswith("usage:"):
        assert len(lines) == 1, done.stderr


def test_version_help_and_usage_lines(commands):
    from mla_multi import __version__

    assert commands["version"].returncode == 0
    assert commands["version"].stdout.strip() == f"mla-multi {__version__}"
    bench = commands["bench_help"]
    assert bench.returncode == 0 and bench.stdout.startswith("usage: mla-multi bench [-h] PHASE")
    assert "rest" not in bench.stdout
    for name, prog in (("bench_decode_help", "mla-multi bench decode"), ("layer_help", "mla-multi bench layer")):
        assert commands[name].returncode == 0 and commands[name].stdout.startswith(f"usage: {prog} "), commands[name].stdout


def test_a_forced_backend_that_cannot_run_the_defaults_keeps_the_command(commands):
    assert commands["forced_help"].returncode == 0, commands["forced_help"].stderr
    info = commands["forced_info"]
    assert info.returncode == 0, info.stderr
    assert "import-time selection (DeepSeek-V3 defaults): no decode backend; The forced decode backend TRITON" in info.stdout
    assert "bfloat16 is not supported under the Triton interpreter" in info.stdout


def test_info_is_quiet_and_its_lines_read(commands):
    a100 = commands["info_a100"]
    assert a100.returncode == 0 and a100.stderr == "", a100.stderr  # no fallback warning, no raw dict
    forced = commands["forced_info"].stdout
    assert "no sm_90 warpgroup kernels (the warpgroup decode kernel needs sm_90" in forced
    assert "warpgroup kernels the warpgroup" not in forced


@pytest.mark.parametrize("arch, name", [("gfx942", "MI300X"), ("gfx950", "MI355X"), ("sm_80", "A100"),
                                        ("sm_90", "H100"), ("sm_100", "B200"), ("GFX942", "MI300X"), ("h200", "H200")])
def test_as_takes_an_arch_or_a_name(arch, name):
    assert cli.resolve_spec(arch).name == name


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible: the benchmarks would run")
@pytest.mark.parametrize("phase", ["decode", "prefill", "layer", "sparse-decode", "sparse-prefill", "dcp"])
def test_every_benchmark_says_it_needs_a_gpu_in_the_same_words(phase, capsys):
    assert cli.main(["bench", phase]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mla-multi bench {phase}: error: needs "), err
    assert "CUDA or ROCm GPU" in err and "torch sees 0" in err


def test_info_shows_the_v4_selection_with_reasons():
    """`mla-multi info` has DeepSeek-V4's sparse phases (d 512, a 584-byte cache and its window segment, a sink):
    on an H200 FLASHMLA comes first and serves them where its wheel is installed (here it is not: its row names
    the wheel), so TRITON serves them there; REFERENCE on the CPU; every other backend of the phase says why it
    rejects the V4 contract."""
    from mla_multi import cli

    for device, selected in (("H200", "TRITON"), ("CPU", "REFERENCE")):
        info = cli.collect_info(device)
        for label, phase in (("sparse_decode_v4", "sparse_decode"), ("sparse_prefill_v4", "sparse_prefill")):
            data = info["phases"][label]
            assert data["config"].startswith("V4 ") and "d_qk=d_v=512" in data["config"], data["config"]
            assert data["selected"] == selected, (device, data["selected"])
            rows = {row["name"]: row for row in data["backends"]}
            if device == "H200":
                assert data["priority"][0] == "FLASHMLA", data["priority"]
                flashmla = rows["FLASHMLA"]["reasons"]  # the V4 contract accepted; only the missing wheel in the way
                assert flashmla and all("sgl-flash-mla" in reason for reason in flashmla), flashmla
                assert "fp8_ds_mla_v4" in rows["FLASHMLA"]["declares"]["v4_formats"] or phase == "sparse_prefill"
            others = [name for name in rows if name not in ("REFERENCE", "TRITON", "FLASHMLA")]
            assert others and all(any("V4 contract" in reason for reason in rows[name]["reasons"]) for name in others)
