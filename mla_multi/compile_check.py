"""Ahead-of-time compilation of every Triton kernel of the package, for every target.

Each kernel module listed in `KERNEL_MODULES` exposes
``compile_specs(platform) -> list[CompileSpec]``: every (kernel, launch
configuration) the code can choose on that platform.  This module compiles each
one with the stock ``triton`` wheel on the CPU — no GPU needed — for AMD
gfx942 (MI300), gfx950 (MI355) and NVIDIA sm_80, sm_90, sm_100::

    triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(...), options=...)

and reports per kernel, configuration and target: registers (VGPRs, AGPRs and
SGPRs on AMD, read from the AMDGCN assembly's ``.vgpr_count`` / ``.agpr_count``
/ ``.sgpr_count``; on NVIDIA the register count and stack frame from
``cuobjdump --dump-resource-usage`` of the cubin, with the cuobjdump that the
triton wheel ships), spills (``.vgpr_spill_count`` + ``.sgpr_spill_count`` on
AMD; the stack frame in bytes on NVIDIA, where Triton kernels keep nothing but
spilled registers), shared memory / LDS, and ``mma_repeat`` (column
``mma_x``): how many warps compute each element of a matrix product (the
largest over the kernel's dots, from the TTGIR's MFMA / WMMA / MMA layouts;
1 where the warps split every product, 2 or 4 where a product smaller than
its warps' tile is computed again by each of them).

It fails (exit status 1) on a compile error, on any spill for gfx942, gfx950
or sm_90, on shared memory over the target's per-block limit, and on sm_90
where ``ptxas`` serialises a kernel's wgmma instructions (its "Potential
Performance Loss" note C7514 and kin, read from ``ptxas -v`` over the
kernel's PTX: every warpgroup product then waits for the one before, as
when an accumulator is read or kept in flight across a loop's back edge).

Usage: ``python -m mla_multi.compile_check --targets gfx942,sm_90 --kernels mla_decode``
(the CLI's ``mla-multi compile-check`` calls `main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from mla_multi.kernels.launch_config import CompileSpec

__all__ = ["KERNEL_MODULES", "TARGETS", "CompileSpec", "CompileResult", "run_checks", "main"]

KERNEL_MODULES: list[str] = [
    "mla_multi.kernels.mla_decode",
    "mla_multi.kernels.cache_ops",
    "mla_multi.kernels.absorb",
    "mla_multi.kernels.prefill",
    "mla_multi.kernels.merge",
    "mla_multi.kernels.dcp_combine",
    "mla_multi.kernels.sparse_indices",
    "mla_multi.kernels.sparse_v4",
]


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target: Triton's (backend, arch, warp size) and the platform it stands for."""

    name: str
    backend: str
    arch: Any
    warp_size: int
    platform_name: str
    spills_fatal: bool

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


TARGETS: dict[str, Target] = {
    "gfx942": Target("gfx942", "hip", "gfx942", 64, "MI300X", True),
    "gfx950": Target("gfx950", "hip", "gfx950", 64, "MI355X", True),
    "sm_80": Target("sm_80", "cuda", 80, 32, "A100", False),
    "sm_90": Target("sm_90", "cuda", 90, 32, "H100", True),
    "sm_100": Target("sm_100", "cuda", 100, 32, "B200", False),
}


_SM_REGISTERS = 65536  # 32-bit registers of one NVIDIA SM (sm_80 / sm_90 / sm_100)


@dataclasses.dataclass
class CompileResult:
    """One compiled kernel instance; registers/spills are None where the target has no such count."""

    kernel: str
    module: str
    target: str
    ok: bool
    seconds: float
    registers: int | None = None
    sgprs: int | None = None
    agprs: int | None = None
    spills: int | None = None
    spill_unit: str = ""
    shared_bytes: int | None = None
    shared_limit: int | None = None
    mma_repeat: int | None = None
    wgmma_serialized: str = ""
    launch_threads: int | None = None  # NVIDIA: threads a launch starts (every partition's warps)
    error: str = ""
    problems: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.ok and not self.problems


def _platform(target: Target):
    from mla_multi.platforms import SPECS

    return SPECS[target.platform_name]


def _attrs(spec: CompileSpec) -> dict:
    # attributes are keyed by the argument's position among the kernel's parameters (as Triton's launcher
    # specialises them), not by its place in the spec's signature
    names = list(getattr(spec.fn, "arg_names", None) or spec.signature)
    attrs = {}
    for name in spec.divisible_by_16:
        if name not in spec.signature or name not in names:
            raise ValueError(f"{spec.name}: divisible_by_16 names {name!r}, which is not an argument")
        attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    return attrs


def _triton_tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _amd_counts(asm: str) -> dict[str, int | None]:
    def read(key: str) -> int | None:
        match = re.search(re.escape(key) + r":\s*(\d+)", asm)
        return int(match.group(1)) if match else None

    vgpr_spills = read(".vgpr_spill_count") or 0
    sgpr_spills = read(".sgpr_spill_count") or 0
    return {
        "registers": read(".vgpr_count"),
        "sgprs": read(".sgpr_count"),
        "agprs": read(".agpr_count"),
        "spills": vgpr_spills + sgpr_spills,
    }


# a matrix-op layout of the TTGIR: its name, warps per CTA (M, N) and the M x N of one instruction
_MMA_LAYOUT = re.compile(r"^(#\w+) = #ttg\.(amd_mfma|amd_wmma|nvidia_mma)<\{(.*?)\}>", re.M)
_MMA_RESULT = re.compile(r"(?:tt\.dot|ttng\.warp_group_dot)\b[^\n]*-> tensor<(\d+)x(\d+)x\w+, (#\w+)>")


def mma_repeat(ttgir: str) -> int | None:
    """How many warps compute each element of the kernel's matrix products (the
    largest over its dots), from the TTGIR; None when the kernel has no dot.

    A dot's result layout puts ``warpsPerCTA = [wm, wn]`` warps on the M x N
    tile, each instruction covering ``im x in`` (MFMA: ``instrShape``; NVIDIA
    MMA: 16 x 8, or 16 x instrShape[1] for wgmma; WMMA: 16 x 16).  A result of
    M x N has ``min(wm, M / im) x min(wn, N / in)`` distinct warp tiles; the
    other warps repeat them.
    """
    layouts: dict[str, tuple[int, int, int, int]] = {}
    for name, kind, body in _MMA_LAYOUT.findall(ttgir):
        warps = re.search(r"warpsPerCTA = \[(\d+), (\d+)\]", body)
        if not warps:
            continue
        instr = re.search(r"instrShape = \[(\d+), (\d+)", body)
        if kind == "amd_mfma" and instr:
            im, inn = int(instr.group(1)), int(instr.group(2))
        elif kind == "nvidia_mma":
            major = re.search(r"versionMajor = (\d+)", body)
            wgmma = major is not None and int(major.group(1)) >= 3 and instr is not None
            im, inn = (16, int(instr.group(2))) if wgmma else (16, 8)
        else:
            im, inn = 16, 16
        layouts[name] = (int(warps.group(1)), int(warps.group(2)), im, inn)
    worst = None
    for rows, cols, layout in _MMA_RESULT.findall(ttgir):
        if layout not in layouts:
            continue
        wm, wn, im, inn = layouts[layout]
        distinct = min(wm, max(1, int(rows) // im)) * min(wn, max(1, int(cols) // inn))
        repeat = wm * wn // distinct
        worst = repeat if worst is None else max(worst, repeat)
    return worst


def _nvidia_counts(cubin: bytes) -> dict[str, int | None]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(cubin)
        path = handle.name
    try:
        usage = subprocess.run(
            [_triton_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(path)
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)", usage)
    if not match:
        raise RuntimeError(f"cuobjdump gave no resource usage: {usage[-300:]!r}")
    return {"registers": int(match.group(1)), "spills": int(match.group(2))}


def wgmma_serialization(ptxas_log: str) -> str:
    """The reason `ptxas -v` gives for serialising a kernel's wgmma instructions, or "" where it gives none."""
    match = re.search(r"wgmma\.mma_async instructions are serialized due to (.*?)(?: in the function|$)", ptxas_log, re.M)
    return " ".join(match.group(1).split()) if match else ""


def _ptxas_log(ptx: str, arch: int) -> str:
    """What the installed Triton's ptxas says (-v) while assembling `ptx` for sm_{arch}a."""
    from triton.backends.nvidia import compiler

    try:
        tool = compiler.get_ptxas(arch)
    except TypeError:  # older Triton: one ptxas for every arch
        tool = compiler.get_ptxas()
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as handle:
            handle.write(ptx)
        run = subprocess.run(
            [getattr(tool, "path", tool), f"-arch=sm_{arch}a", "-v", source, "-o", os.path.join(folder, "kernel.cubin")],
            capture_output=True, text=True, check=True,
        )
    return run.stdout + run.stderr


def compile_one(module_name: str, index: int, target_name: str) -> CompileResult:
    """Compile spec `index` of `module_name` for `target_name` (runs in a worker process)."""
    module = importlib.import_module(module_name)
    spec: CompileSpec = module.compile_specs(_platform(TARGETS[target_name]))[index]
    return compile_spec(spec, target_name, module_name)


def _options(spec: CompileSpec) -> dict:
    """The spec's options, with FP fusion stated as the installed Triton's default: the same code as a launch
    compiles, without Triton 3.9's warning (in every worker process) that the default is unset."""
    options = dict(spec.options)
    if "enable_fp_fusion" not in options:
        import triton

        language = getattr(getattr(triton, "knobs", None), "language", None)
        default = getattr(language, "default_fp_fusion", None)
        if default is not None and not getattr(language, "force_disable_fp_fusion", False):
            options["enable_fp_fusion"] = bool(default)
    return options


def _with_defaults(spec: CompileSpec) -> tuple[dict, dict]:
    """The spec's signature and constexprs, with every kernel parameter the spec leaves out at its default (a
    constexpr, as a launch that does not pass it compiles it: a switch off, a pointer None), in the kernel's
    order."""
    signature, constexprs = {}, dict(spec.constexprs)
    for param in spec.fn.params:
        name = param.name
        if name in spec.signature:
            signature[name] = spec.signature[name]
        elif param.has_default:
            signature[name] = "constexpr"
            constexprs.setdefault(name, param.default)
    return signature, constexprs


def compile_kernel(spec: CompileSpec, target_name: str):
    """`spec` compiled for `target_name` as a launch specialises it (Triton's compiled kernel: its `asm` holds
    the PTX or AMDGCN)."""
    import triton
    from triton.compiler import ASTSource

    source_cls = ASTSource
    if getattr(spec.fn, "is_gluon", lambda: False)():
        # Gluon kernels need their layouts' module attributes set before the body is built
        from triton.experimental.gluon._runtime import GluonASTSource as source_cls
    signature, constexprs = _with_defaults(spec)
    source = source_cls(fn=spec.fn, signature=signature, constexprs=constexprs, attrs=_attrs(spec))
    return triton.compile(source, target=TARGETS[target_name].gpu_target(), options=_options(spec))


def compile_spec(spec: CompileSpec, target_name: str, module_name: str = "") -> CompileResult:
    """Compile one spec for `target_name` and judge it (compile error, spills, shared memory)."""
    target = TARGETS[target_name]
    limit = _platform(target).max_shared_memory_per_block
    result = CompileResult(
        kernel=spec.name,
        module=module_name,
        target=target_name,
        ok=False,
        seconds=0.0,
        shared_limit=limit,
    )
    start = time.perf_counter()
    try:
        compiled = compile_kernel(spec, target_name)
        result.shared_bytes = int(compiled.metadata.shared)
        result.mma_repeat = mma_repeat(compiled.asm.get("ttgir", ""))
        if target.backend == "hip":
            counts = _amd_counts(compiled.asm["amdgcn"])
            result.spill_unit = "registers"
        else:
            counts = _nvidia_counts(compiled.asm["cubin"])
            result.spill_unit = "stack bytes"
            if target.arch == 90:
                result.wgmma_serialized = wgmma_serialization(_ptxas_log(compiled.asm["ptx"], 90))
        for key, value in counts.items():
            setattr(result, key, value)
        if target.backend == "cuda":
            # every warp of the launch (a warp-specialised kernel's workers included) holds the register
            # count at launch: past the SM's 64K registers the launch fails (Triton: "out of resource: threads")
            result.launch_threads = int(compiled.metadata.num_warps) * target.warp_size
        result.ok = True
    except Exception as error:  # a compile error is a result, reported with the rest
        result.error = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
    result.seconds = time.perf_counter() - start
    if result.ok:
        if result.spills and target.spills_fatal:
            result.problems.append(f"{result.spills} spilled {result.spill_unit}")
        if result.wgmma_serialized:
            result.problems.append(f"ptxas serialises its wgmma instructions ({result.wgmma_serialized})")
        if result.launch_threads and result.registers and result.launch_threads * result.registers > _SM_REGISTERS:
            result.problems.append(
                f"{result.launch_threads} threads x {result.registers} registers at launch exceed the SM's "
                f"{_SM_REGISTERS}"
            )
        if result.shared_bytes is not None and result.shared_bytes > limit:
            result.problems.append(f"shared memory {result.shared_bytes} B over the {limit} B limit")
    else:
        result.problems.append("compile error")
    return result


def _jobs(targets: list[str], kernel_filters: list[str], modules: list[str]) -> list[tuple[str, int, str]]:
    jobs = []
    for target_name in targets:
        platform = _platform(TARGETS[target_name])
        for module_name in modules:
            module = importlib.import_module(module_name)
            for index, spec in enumerate(module.compile_specs(platform)):
                if kernel_filters and not any(text in spec.name for text in kernel_filters):
                    continue
                jobs.append((module_name, index, target_name))
    return jobs


def run_checks(
    targets: list[str] | None = None,
    kernel_filters: list[str] | None = None,
    jobs: int | None = None,
    modules: list[str] | None = None,
) -> list[CompileResult]:
    """Compile every selected kernel instance; returns one `CompileResult` per (instance, target)."""
    targets = list(targets or TARGETS)
    for name in targets:
        if name not in TARGETS:
            raise ValueError(f"target {name!r}; accepted: {', '.join(TARGETS)}")
    work = _jobs(targets, kernel_filters or [], modules or KERNEL_MODULES)
    workers = jobs if jobs is not None else min(len(work), os.cpu_count() or 1)
    if workers <= 1 or len(work) <= 1:
        return [compile_one(*job) for job in work]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(compile_one, *zip(*work)))


def _format(results: list[CompileResult]) -> str:
    header = (
        f"{'target':7} {'kernel':70} {'regs':>5} {'sgpr':>5} {'agpr':>5} {'spills':>7} {'shared':>8} {'limit':>7} "
        f"{'mma_x':>5} {'s':>5}  status"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        def show(value):
            return "-" if value is None else str(value)

        status = "ok" if r.passed else "FAIL: " + "; ".join(r.problems) + (f" ({r.error})" if r.error else "")
        lines.append(
            f"{r.target:7} {r.kernel[:70]:70} {show(r.registers):>5} {show(r.sgprs):>5} {show(r.agprs):>5} "
            f"{show(r.spills):>7} {show(r.shared_bytes):>8} {show(r.shared_limit):>7} {show(r.mma_repeat):>5} "
            f"{r.seconds:5.1f}  {status}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line entry; returns 0 when every instance compiled cleanly, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="mla-multi compile-check", description="Compile every Triton kernel for every target on the CPU."
    )
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)}")
    parser.add_argument("--kernels", default="", help="comma list of substrings of kernel names (default: all)")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: the CPU count)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    targets = [name.strip() for name in args.targets.split(",") if name.strip()]
    filters = [text.strip() for text in args.kernels.split(",") if text.strip()]
    try:
        start = time.perf_counter()
        results = run_checks(targets, filters, args.jobs)
        elapsed = time.perf_counter() - start
    except ValueError as error:
        print(f"mla-multi compile-check: error: {error}", file=sys.stderr)
        return 2
    print(_format(results))
    failed = [r for r in results if not r.passed]
    print(f"\n{len(results)} kernel instances, {len(failed)} failed, {elapsed:.1f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([dataclasses.asdict(r) for r in results], handle, indent=1)
    if not results:
        print("compile-check: no kernel matched the filters", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
