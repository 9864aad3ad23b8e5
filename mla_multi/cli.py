"""`mla-multi info | demo | warmup | bench | compile-check`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import platform as host_platform
import sys
import time

_LIBRARIES = ("torch", "triton", "pytorch-triton-rocm", "amd-aiter", "flash-attn", "flash-attn-3", "flashinfer-python",
              "flashinfer-jit-cache", "packaging")


def _guarded(probe, default="could not collect"):
    """Run a probe; any exception becomes a string instead of a crash (PyTorch collect_env's rule)."""
    try:
        return probe()
    except Exception as error:  # noqa: BLE001 - a report must never crash
        return f"{default} ({type(error).__name__}: {error})"


def library_versions() -> dict[str, str | None]:
    """Installed distribution versions, read from metadata without importing the libraries."""

    def version(name: str):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {name: _guarded(lambda n=name: version(n)) for name in _LIBRARIES}


def _triton_interpreter_note() -> str | None:
    """What TRITON_INTERPRET=1 changes (None when it is off)."""
    from mla_multi.kernels import interpreter_active

    if not interpreter_active():
        return None
    return ("on (TRITON_INTERPRET=1): the interpreter is what makes TRITON run on the CPU; force it with "
            "backend='TRITON' or MLA_MULTI_PREFILL_BACKEND / MLA_MULTI_DECODE_BACKEND=TRITON (float16; float32 "
            "for prefill; no bfloat16: the interpreter computes its tl.dot wrongly); the cache ops and "
            "merge_attn_states run their Triton kernels on CPU tensors too")


_KERNEL_NAMES = {
    "triton": "Triton kernel",
    "wgmma_ws": "sm_90 warp-specialised warpgroup kernel",
    "wgmma_rm": "sm_90 warp-specialised warpgroup kernel, rows as M",
}


def _triton_decode_kernels(platform) -> dict:
    """Which decode kernel TRITON launches per head count and cache dtype on `platform` (DeepSeek dims),
    and why the sm_90 warpgroup kernels cannot run there, if they cannot."""
    import torch

    from mla_multi.kernels.launch_config import decode_config, wgmma_decode_reason

    kernels = {}
    for kv in ("bfloat16", "float8_e4m3fn"):
        for heads in (16, 32, 128):
            config = decode_config(platform, heads, 1, getattr(torch, kv))
            kernels[f"{kv}, {heads} heads"] = f"{config.name} ({_KERNEL_NAMES.get(config.kernel, config.kernel)})"
    return {"kernels": kernels, "warpgroup_kernels": wgmma_decode_reason(platform, torch.bfloat16) or "available"}


def _triton_prefill_kernel(platform) -> dict:
    """Which kernel TRITON's default prefill launch uses on `platform` (DeepSeek dims, the platform's dtype),
    and why not the sm_90 Gluon kernel, if not."""
    import mla_multi as mm
    from mla_multi.kernels.prefill_wgmma import wgmma_prefill_reason

    dtype = mm.DEFAULT_DTYPE
    reason = wgmma_prefill_reason(platform, dtype, 192, 128)
    if reason:
        from mla_multi.kernels.launch_config import prefill_config

        config = prefill_config(platform, 192, 128, dtype, True)
        order = (f", its programs ordered for {config.xcds} XCDs (a head's query tiles on one L2)"
                 if config.xcds > 1 else "")
        return {"kernel": f"the Triton kernel (mla_multi.kernels.prefill), causal launch {config.name}{order}",
                "sm90_kernel": reason}
    return {"kernel": ("the sm_90 Gluon kernel in FlashAttention-3's structure (mla_multi.kernels.prefill_wgmma); "
                       "the Triton kernel for chunks merged in the kernel, tensors whose rows do not start on "
                       "16 bytes and fewer than 128 rows"),
            "sm90_kernel": "available"}


def resolve_spec(text: str):
    """The ready platform spec named `text`: a device name (MI300X, H100, ...) or an arch (gfx942, sm_90, ...).

    An arch takes the first spec of that arch in `platforms.specs.SPECS` (gfx942: MI300X, sm_90: H100).
    """
    from mla_multi.platforms.specs import SPECS

    wanted = text.strip().lower()
    for name, spec in SPECS.items():
        if name.lower() == wanted:
            return spec
    for spec in SPECS.values():
        if spec.arch.lower() == wanted and spec.vendor != "cpu":
            return spec
    archs = list(dict.fromkeys(spec.arch for spec in SPECS.values() if spec.vendor != "cpu"))
    raise ValueError(f"unknown platform spec {text!r}; accepted: a device name ({', '.join(SPECS)}) "
                     f"or an arch ({', '.join(archs)})")


def collect_info(as_spec: str | None = None) -> dict:
    """Everything `mla-multi info` prints, as a JSON-friendly dict."""
    import torch

    import mla_multi as mm
    from mla_multi import envs, platforms, registry
    from mla_multi.dims import MLADims

    info: dict = {"mla_multi": mm.__version__, "python": sys.version.split()[0], "host": host_platform.platform()}
    info["torch_build"] = _guarded(
        lambda: {"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
    )
    info["libraries"] = library_versions()
    info["environment"] = envs.overrides_in_force()
    info["triton_interpreter"] = _guarded(_triton_interpreter_note)
    detected = platforms.current_platform()
    info["detected_platform"] = detected.describe()
    info["detection_error"] = platforms.detection_error()
    target = resolve_spec(as_spec) if as_spec else detected
    info["platform"] = target.describe()
    info["impersonated"] = as_spec is not None

    info["import_selection_errors"] = mm.import_selection_errors()
    dims = MLADims.deepseek_v3()
    dtype = mm.DEFAULT_DTYPE
    with platforms.override(target), _quiet_registry(as_spec is not None):
        v4 = MLADims(dims.num_heads, kv_lora_rank=448, qk_rope_head_dim=64)  # DeepSeek-V4: d 512 = 448 + 64
        configs = {  # label -> (phase, configuration)
            "prefill": ("prefill", registry.prefill_config(dims, dtype)),
            "decode": ("decode", registry.decode_config(dims, dtype, "auto", 64, platform=target)),
            # DeepSeek-V3.2: top-2048 indices over the fp8_ds_mla cache (decode) and the bf16 rows (prefill)
            "sparse_decode": ("sparse_decode", registry.sparse_config(dims, dtype, torch.uint8, 2048)),
            "sparse_prefill": ("sparse_prefill", registry.sparse_config(dims, dtype, dtype, 2048)),
            # DeepSeek-V4: top-512 over the 584-byte cache and a 128-token window in its own, a sink
            "sparse_decode_v4": ("sparse_decode", registry.sparse_config(
                v4, dtype, torch.uint8, 512 + 128, kv_format="fp8_ds_mla_v4", extra_kv_format="fp8_ds_mla_v4",
                with_sink=True)),
            "sparse_prefill_v4": ("sparse_prefill", registry.sparse_config(v4, dtype, dtype, 2048, kv_format="rows",
                                                                           with_sink=True)),
        }
        phases = {}
        for label, (phase, config) in configs.items():
            rows = _guarded(lambda p=phase, c=config: registry.default_registry.explain(p, c, target), default="[]")
            forced = _guarded(lambda p=phase: registry._forced_from_env(p))
            selected = None
            try:
                selected = registry.default_registry.select(phase, config, target).name
            except Exception as error:  # the reasons are the report
                selected = f"none: {error}"
            order, rules = registry.default_registry.ordering(phase, target, config)
            phases[label] = {"config": config.describe(),
                             "priority": list(order),
                             "rule": "; ".join(rule.describe() for rule in rules) or None,
                             "rules": [{"name": r.name, "delta": r.delta(), "measured": r.measured} for r in rules],
                             "forced": forced, "selected": selected, "backends": rows}
            if label == "sparse_decode":  # each call is planned with its token count: a rule may choose by it
                phases[label]["one_token"] = _guarded(lambda c=config: _one_token_choice(c, target))
            if label == "decode":  # so is each dense decode call: a rule may choose by its batch
                phases[label]["by_num_tokens"] = _guarded(lambda c=config: _by_num_tokens(c, target), default=[])
            for row in rows if isinstance(rows, list) else []:
                backend = _guarded(lambda p=phase, n=row["name"]: registry.default_registry.load(p, n), default=None)
                if hasattr(backend, "info"):
                    row["declares"] = _guarded(backend.info)
        info["phases"] = phases
        info["workspace"] = _guarded(lambda: _workspace_plans(dtype))
    info["rocm_aiter_decode"] = _guarded(lambda: _rocm_aiter_routes(target))
    info["triton_decode"] = _guarded(lambda: _triton_decode_kernels(target))
    info["triton_prefill"] = _guarded(lambda: _triton_prefill_kernel(target))
    return info


def _rocm_aiter_routes(target) -> dict | None:
    """ROCM_AITER's decode routes on a gfx942 / gfx950 target, from aiter's kernel tables (None elsewhere)."""
    if target.vendor != "rocm":
        return None
    from mla_multi.backends.rocm_aiter import route_table

    return route_table(target)


@contextlib.contextmanager
def _quiet_registry(quiet: bool):
    """Hold back the registry's fallback warnings while it selects for an impersonated device: the report
    prints every rejected backend's reasons itself."""
    import logging

    logger = logging.getLogger("mla_multi")  # the registry's logger
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _one_token_choice(config, target) -> dict | None:
    """The sparse decode backend a planned call of one token gets, where a rule makes it differ."""
    import dataclasses

    from mla_multi import registry

    one = dataclasses.replace(config, num_tokens=1)
    rule = registry.default_registry.rule_for("sparse_decode", target, one)
    if rule is None:
        return None
    return {"selected": registry.default_registry.select("sparse_decode", one, target).name, "rule": rule.describe()}


def _by_num_tokens(config, target) -> list[dict]:
    """Where a rule orders a call planned with its token count (batch x query length) otherwise than the
    layer's order without a count: for each range of counts, the order, the backend it gets and the rules."""
    import dataclasses

    from mla_multi import registry

    chosen = registry.default_registry
    bounds = [1] + [b for b in chosen.num_tokens_bounds("decode") if b > 1]
    result = []
    for i, low in enumerate(bounds):
        high = bounds[i + 1] - 1 if i + 1 < len(bounds) else None
        planned = dataclasses.replace(config, num_tokens=low)
        order, rules = chosen.ordering("decode", target, planned)
        try:
            selected = chosen.select("decode", planned, target).name
        except Exception as error:  # the reasons are the report
            selected = f"none: {error}"
        result.append({"num_tokens": f"{low}-{high}" if high is not None else f"{low}+", "selected": selected,
                       "priority": list(order), "rule": "; ".join(rule.describe() for rule in rules) or None})
    if all(entry["priority"] == list(chosen.priority("decode", target, config)) for entry in result):
        return []
    return result


def _workspace_plans(dtype) -> list[str]:
    """What the shared workspace holds for DeepSeek-V3 at 16 and 128 heads (256 sequences of 32768 tokens)."""
    from mla_multi.dims import MLADims
    from mla_multi.memory import memory_plan

    return [str(memory_plan(MLADims.deepseek_v3(num_heads=heads), 256, 32768, dtype=dtype)) for heads in (16, 128)]


def _print_info(info: dict) -> None:
    p = info["platform"]
    title = "impersonated" if info["impersonated"] else "detected"
    print(f"mla_multi {info['mla_multi']}  python {info['python']}  {info['host']}")
    print(f"platform ({title}): {p['name']}  vendor={p['vendor']} arch={p['arch']} "
          f"compute_units={p['num_compute_units']} warp_size={p['warp_size']} fp8={p['fp8_dtype']} "
          f"shared_memory_per_block={p['max_shared_memory_per_block']}"
          + (f" xcds={p['num_xcds']}" if p["num_xcds"] > 1 else ""))
    if info["impersonated"]:
        d = info["detected_platform"]
        print(f"detected platform: {d['name']} ({d['vendor']} {d['arch']})")
    if info["detection_error"]:
        print(f"GPU detection failed, using the CPU: {info['detection_error']}")
    print("torch build: " + json.dumps(info["torch_build"]))
    print("libraries: " + ", ".join(f"{k}={v or '-'}" for k, v in info["libraries"].items()))
    env = info["environment"]
    print("environment overrides: " + (", ".join(f"{k}={v}" for k, v in env.items()) if env else "none"))
    for phase, error in info.get("import_selection_errors", {}).items():
        print(f"import-time selection (DeepSeek-V3 defaults): no {phase} backend; "
              + error.splitlines()[0].rstrip(":") + " (reasons below); selected_backends() raises it")
    if info.get("triton_interpreter"):
        print(f"Triton interpreter: {info['triton_interpreter']}")
    for phase, data in info["phases"].items():
        print(f"\n{phase}: selected {data['selected']}")
        print(f"  config: {data['config']}")
        print(f"  priority: {' > '.join(data['priority']) or '(none)'}"
              + (f"  ({'rules' if len(data.get('rules', ())) > 1 else 'rule'} {data['rule']})" if data.get("rule")
                 else "  (the platform's list)"))
        one_token = data.get("one_token")
        if isinstance(one_token, dict):
            print(f"  a call of one token: {one_token['selected']}  (rule {one_token['rule']})")
        by_tokens = data.get("by_num_tokens")
        for entry in by_tokens if isinstance(by_tokens, list) else []:
            print(f"  a call of {entry['num_tokens']} tokens: {entry['selected']}, {' > '.join(entry['priority'])}"
                  + (f"  (rules {entry['rule']})" if entry["rule"] else "  (the platform's list)"))
        for row in data["backends"] if isinstance(data["backends"], list) else []:
            state = "SELECTED" if row["selected"] else ("available" if row["available"] else "unavailable")
            declares = row.get("declares") if isinstance(row.get("declares"), dict) else {}
            uses = declares.get("implementation")
            print(f"  {row['name']:<16} {state}" + (f"  (uses {uses})" if uses else ""))
            for reason in row["reasons"]:
                print(f"      - {reason}")
    aiter = info.get("rocm_aiter_decode")
    if isinstance(aiter, dict):
        print(f"\nROCM_AITER decode routes (aiter {aiter['aiter_source']} kernel tables; query tokens 1-4):")
        for kv, rows in aiter["routes"].items():
            for heads, row in rows.items():
                print(f"  {kv:<16} {heads:>3} heads  " + " | ".join(f"{q}: {text}" for q, text in row.items()))
    plans = info.get("workspace")
    if isinstance(plans, list):
        print("\nShared workspace (one per device, every layer; DeepSeek-V3, max_num_seqs 256, max_model_len 32768):")
        for plan in plans:
            print("  " + plan.replace("\n", "\n  "))
    decode = info.get("triton_decode")
    if isinstance(decode, dict):
        warpgroup = decode["warpgroup_kernels"]
        print("\nTRITON decode kernels (DeepSeek dims): "
              + ("the sm_90 warpgroup kernels are available" if warpgroup == "available"
                 else f"no sm_90 warpgroup kernels ({warpgroup})"))
        for case, kernel in decode["kernels"].items():
            print(f"  {case:<28} {kernel}")
    prefill = info.get("triton_prefill")
    if isinstance(prefill, dict):
        print(f"TRITON prefill kernel (DeepSeek dims): {prefill['kernel']}"
              + ("" if prefill["sm90_kernel"] == "available" else f"; not the sm_90 kernel: {prefill['sm90_kernel']}"))


def cmd_info(args) -> int:
    info = collect_info(args.as_spec)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        _print_info(info)
    return 0


def cmd_demo(args) -> int:
    import torch

    import mla_multi as mm
    from mla_multi.testing import PagedScenario, relative_error

    platform = mm.current_platform()
    device = platform.torch_device
    on_gpu = platform.is_gpu()
    num_heads = args.num_heads or (128 if on_gpu else 16)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    dims = mm.MLADims.deepseek_v3(num_heads=num_heads)
    block_size = 64
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                          generator=generator) / dims.kv_lora_rank**0.5).to(dtype).to(device)
    scale = dims.qk_head_dim**-0.5
    if args.v4 is not None:
        return _demo_v4(args, mm, platform, device, on_gpu, dtype)
    if args.sparse:
        return _demo_sparse(args, mm, platform, device, on_gpu, num_heads, dtype, tolerance, dims, block_size, weight,
                            scale)
    layer = mm.MLAAttention(dims, scale, weight, block_size=block_size, max_model_len=8192, max_num_seqs=64,
                            workspace_tokens=args.workspace_tokens)
    num_blocks = 512
    scenario = PagedScenario(dims, block_size, num_blocks, device, dtype, seed=0)
    cache = torch.zeros(num_blocks, block_size, dims.kv_cache_width, dtype=dtype, device=device)
    steps = [
        [(0, 300), (1, 45), (2, 700)],                         # fresh prefills
        [(0, 1), (1, 1), (3, 120), (2, 64)],                   # decodes + prefill with cached context
        [(3, 1), (0, 1), (1, 1), (2, 1), (4, 200)],
        [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)],              # pure decode
        [(4, 1), (0, 1), (2, 300)],                            # long cached context, chunked
    ]
    print(f"platform: {platform.name} ({platform.vendor} {platform.arch}); device {device}")
    print(f"layer: DeepSeek-V3 MLA, {num_heads} heads, {dtype}, block size {block_size}, "
          f"workspace {layer.workspace_tokens} tokens")
    print("backends: " + " ".join(f"{phase}={name}" for phase, name in layer.backends().items()))
    worst = 0.0
    for index, requests in enumerate(steps):
        metadata, q, kv_c, k_pe = scenario.step(requests)
        # A step may be run twice (it writes the same cache slots with the same
        # values); the timed second run leaves Triton's compilation out.
        layer.forward(q, kv_c, k_pe, cache, metadata)
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = layer.forward(q, kv_c, k_pe, cache, metadata)
        if on_gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        error = relative_error(out, scenario.reference(requests, q, scale, weight).to(out.device))
        worst = max(worst, error)
        decodes = sum(1 for _, n in requests if n == 1)
        print(f"step {index}: {decodes} decodes, {len(requests) - decodes} prefills, {metadata.num_actual_tokens} tokens, "
              f"max seq_len {metadata.max_seq_len}: rel err {error:.2e}, {elapsed * 1e3:.1f} ms")
    status = "OK" if worst <= tolerance else "FAILED"
    print(f"max relative error vs naive float64 MLA: {worst:.2e} (tolerance {tolerance:.0e}) {status}")
    return 0 if worst <= tolerance else 1


def _demo_sparse(args, mm, platform, device, on_gpu, num_heads, dtype, tolerance, dims, block_size, weight, scale):
    """`mla-multi demo --sparse`: a DeepSeek-V3.2-shaped sparse layer (top-k positions from a stand-in
    indexer, the fp8_ds_mla cache), mixed steps, checked against naive float64 sparse MLA."""
    import torch

    from mla_multi.testing import PagedScenario, relative_error

    topk = 2048 if on_gpu else 64
    layer = mm.MLAAttention(dims, scale, weight, block_size=block_size, max_model_len=8192, max_num_seqs=64,
                            sparse_topk=topk, kv_cache_dtype="fp8_ds_mla")
    num_blocks = 512
    scenario = PagedScenario(dims, block_size, num_blocks, device, dtype, seed=0)
    cache = torch.zeros(num_blocks, block_size, 656, dtype=torch.uint8, device=device)
    steps = [[(0, 300), (1, 45), (2, 700)], [(0, 1), (1, 1), (3, 120), (2, 64)], [(3, 1), (0, 1), (1, 1), (2, 1)]]
    # FP8 tiles with per-128-value scales: the bound of the FP8 caches (DESIGN: 6e-2)
    bound = 6e-2
    print(f"platform: {platform.name} ({platform.vendor} {platform.arch}); device {device}")
    print(f"sparse layer: DeepSeek-V3.2 MLA, {num_heads} heads, {dtype}, top-{topk}, fp8_ds_mla cache, "
          f"block size {block_size}; backends: " + ", ".join(f"{k}={v}" for k, v in layer.backends().items()))
    worst = 0.0
    for index, requests in enumerate(steps):
        metadata, q, kv_c, k_pe = scenario.step(requests)
        positions = scenario.topk_positions(requests, topk).to(device)
        out = layer.forward(q, kv_c, k_pe, cache, metadata, topk_indices=positions)
        error = relative_error(out, scenario.sparse_reference(requests, q, scale, weight, positions.cpu()).to(out.device))
        worst = max(worst, error)
        print(f"step {index}: {metadata.num_actual_tokens} tokens over {len(requests)} requests, max seq_len "
              f"{metadata.max_seq_len}: rel err {error:.2e}")
    status = "OK" if worst <= bound else "FAILED"
    print(f"max relative error vs naive float64 sparse MLA (unquantised rows): {worst:.2e} (bound {bound:.0e}) {status}")
    return 0 if worst <= bound else 1


# `mla-multi demo --v4 FORMATS`: the main cache's format and the window cache's
_V4_DEMO_FORMATS = {"584": ("fp8_ds_mla_v4", None), "528": ("fp8_ds_mla_v41", None),
                    "528+288": ("fp8_ds_mla_v41", "fp4_ds_mla_v41")}


def _demo_v4(args, mm, platform, device, on_gpu, dtype):
    """`mla-multi demo --v4`: a DeepSeek-V4-shaped layer (`MLAAttentionV4`: d 512, the top-k segment over the
    compressed rows of a stand-in compressor (one row per 4 tokens) and indexer, a 128-token window, a
    sink), decodes (MTP included) and prefills, checked against naive float64 V4 attention over the
    dequantised caches."""
    import torch

    from mla_multi import cache_formats
    from mla_multi.testing import relative_error

    kv_format, window_kv_format = _V4_DEMO_FORMATS[args.v4]
    num_heads = args.num_heads or (64 if on_gpu else 8)  # DeepSeek-V4 Flash: 64 heads
    topk, window, ratio = (512, 128, 4) if on_gpu else (64, 128, 4)
    block_size, main_block, max_blocks = 64, 64, 64
    generator = torch.Generator().manual_seed(0)
    layer = mm.MLAAttentionV4(num_heads, 512**-0.5, block_size=block_size, max_model_len=max_blocks * block_size,
                              max_num_seqs=16, topk=topk, window_size=window, kv_format=kv_format,
                              window_kv_format=window_kv_format, dtype=dtype, device=device)
    layer.attn_sink.data = (torch.randn(num_heads, generator=generator) + 2.0).to(device)  # a loaded sink
    window_cache, kv_cache = layer.allocate_window_cache(512), layer.allocate_kv_cache(256, main_block)
    free_blocks = torch.randperm(512, generator=generator).tolist()
    free_slots = torch.randperm(256 * main_block, generator=generator).tolist()
    tables: dict = {}      # request -> its window-cache blocks
    compressed: dict = {}  # request -> the main-cache slots of its compressed rows, in order
    lengths: dict = {}
    steps = [
        ([(0, 300), (1, 45), (2, 500)], 1),                  # fresh prefills
        ([(0, 1), (1, 1), (2, 1)], 1),                       # decodes
        ([(0, 4), (1, 2), (3, 120), (2, 64)], 4),            # MTP decodes + prefills (one with context)
        ([(3, 1), (0, 3), (1, 1), (2, 2)], 4),               # MTP decodes
    ]
    print(f"platform: {platform.name} ({platform.vendor} {platform.arch}); device {device}")
    print(f"V4 layer: DeepSeek-V4 sparse MLA (d 512, top-{topk} of one compressed row per {ratio} tokens, a "
          f"{window}-token window, a sink), {num_heads} heads, {dtype}, caches {kv_format} + window "
          f"{window_kv_format or kv_format}; backends: " + ", ".join(f"{k}={v}" for k, v in layer.backends().items()))
    worst = 0.0
    for index, (requests, threshold) in enumerate(steps):
        query_lens, seq_lens, table = [], [], []
        rows_c, slots_c = [], []
        for request, new in requests:
            length = lengths.get(request, 0) + new
            blocks = tables.setdefault(request, [])
            while len(blocks) * block_size < length:
                blocks.append(free_blocks.pop())
            mine = compressed.setdefault(request, [])
            while len(mine) < length // ratio:  # the stand-in compressor's new rows
                mine.append(free_slots.pop())
                slots_c.append(mine[-1])
            lengths[request] = length
            query_lens.append(new)
            seq_lens.append(length)
            table.append(blocks + [0] * (max_blocks - len(blocks)))
        metadata = mm.CommonAttentionMetadata.from_lengths(
            query_lens, seq_lens, torch.tensor(table, dtype=torch.int32, device=device), block_size, threshold)
        tokens = metadata.num_actual_tokens
        q = torch.randn(tokens, num_heads, 512, generator=generator).to(dtype).to(device)
        kv = torch.randn(tokens, 512, generator=generator).to(dtype).to(device)
        compressed_kv = torch.randn(len(slots_c), 512, generator=generator).to(dtype).to(device)
        # the stand-in indexer: each token's top-k of its request's compressed rows so far (causal), as slots
        positions = [(r, lengths[r] - new + i) for r, new in requests for i in range(new)]
        picks = torch.full((tokens, topk), -1, dtype=torch.int32)
        counts = torch.zeros(tokens, dtype=torch.int32)
        for t, (request, position) in enumerate(positions):
            visible = compressed[request][: (position + 1) // ratio]
            chosen = torch.randperm(len(visible), generator=generator)[:topk].tolist()
            picks[t, : len(chosen)] = torch.tensor([visible[c] for c in chosen], dtype=torch.int32)
            counts[t] = len(chosen)
        layer.plan(metadata)
        out = layer(q, kv, kv_cache, window_cache, metadata, topk_indices=picks.to(device),
                    topk_length=counts.to(device), compressed_kv=compressed_kv,
                    compressed_slot_mapping=torch.tensor(slots_c, dtype=torch.int64, device=device))
        # naive float64 V4 attention over the dequantised caches: one softmax over both segments, the sink
        window_slots = torch.full((tokens, window), -1, dtype=torch.int64)
        for t, (request, position) in enumerate(positions):
            back = range(position, max(-1, position - window), -1)
            window_slots[t, : len(back)] = torch.tensor([tables[request][p // block_size] * block_size
                                                         + p % block_size for p in back])
        keys = []
        for cache, fmt, slots in ((kv_cache, kv_format, picks.long()),
                                  (window_cache, window_kv_format or kv_format, window_slots)):
            every_row = cache_formats.get_format(fmt).read_rows(cache.cpu(), torch.float64)  # the whole cache
            keys.append((every_row[slots.clamp(min=0)], slots >= 0))
        rows = torch.cat([keys[0][0], keys[1][0]], dim=1)
        valid = torch.cat([keys[0][1], keys[1][1]], dim=1)
        scores = torch.einsum("thd,tkd->thk", q.cpu().double(), rows) * layer.scale
        scores = scores.masked_fill(~valid.unsqueeze(1), -torch.inf)
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        ref = torch.einsum("thk,tkd->thd", torch.softmax(scores, dim=-1), rows)
        ref = ref * torch.sigmoid(lse - layer.attn_sink.cpu().double().view(1, -1, 1))
        error = relative_error(out, ref.reshape(tokens, -1))
        worst = max(worst, error)
        decodes = sum(1 for _, n in requests if n <= threshold)
        print(f"step {index}: {decodes} decodes (up to {threshold} tokens each), {len(requests) - decodes} prefills, "
              f"{tokens} tokens, {len(slots_c)} compressed rows written, max seq_len {metadata.max_seq_len}: "
              f"rel err {error:.2e}")
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    status = "OK" if worst <= tolerance else "FAILED"
    print(f"max relative error vs naive float64 V4 attention (dequantised caches): {worst:.2e} "
          f"(tolerance {tolerance:.0e}) {status}")
    return 0 if worst <= tolerance else 1


def cmd_warmup(args) -> int:
    """Build or load every kernel one layer configuration uses, ahead of serving (FlashInfer's JIT, Triton's compile)."""
    import torch

    import mla_multi as mm
    from mla_multi.testing import PagedScenario

    platform = mm.current_platform()
    device = platform.torch_device
    dtype = getattr(torch, args.dtype) if platform.is_gpu() else torch.float32
    dims = mm.MLADims.deepseek_v3(num_heads=args.num_heads)
    block_size = args.block_size
    weight = torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                         dtype=dtype, device=device) / dims.kv_lora_rank**0.5
    # One block of context per chunk, so the context path (gather, chunk, merge) runs too.
    layer = mm.MLAAttention(
        dims, dims.qk_head_dim**-0.5, weight, block_size=block_size, max_model_len=8 * block_size, max_num_seqs=4,
        kv_cache_dtype=args.kv_cache_dtype, kv_cache_scale=1.0 if args.kv_cache_dtype.startswith("fp8") else None,
        workspace_tokens=block_size,
    )
    print(f"warmup on {platform.name}: {dims.num_heads} heads, {dtype}, kv cache {layer.kv_cache_dtype}, "
          f"block size {block_size}; backends " + " ".join(f"{phase}={name}" for phase, name in layer.backends().items()))
    scenario = PagedScenario(dims, block_size, 16, device, dtype, seed=0)
    cache = torch.zeros(16, block_size, dims.kv_lora_rank + dims.qk_rope_head_dim, device=device).to(layer.kv_cache_dtype)
    for name, requests in (("prefill", [(0, block_size + 3)]), ("decode + prefill", [(0, 1), (1, 2 * block_size)]),
                           ("decode + prefill over chunked context", [(0, 1), (1, 5)])):
        metadata, q, kv_c, k_pe = scenario.step(requests)
        start = time.perf_counter()
        layer.forward(q, kv_c, k_pe, cache, metadata)
        if platform.is_gpu():
            torch.cuda.synchronize()
        print(f"  {name}: {time.perf_counter() - start:.2f} s")
    return 0


_BENCH_PHASES = ("decode", "prefill", "dcp", "layer", "sparse-decode", "sparse-prefill")


class UsageError(Exception):
    """A mistake in how the command was called: printed as one line, exit status 2."""


def _run_module_main(prog: str, main, argv: list[str]) -> int:
    """Run a module's `main(argv)` with its argparse usage lines naming the whole command (`prog`)."""
    saved = sys.argv[0] if sys.argv else None
    if sys.argv:
        sys.argv[0] = prog  # argparse's default prog is the basename of sys.argv[0]
    else:
        sys.argv.append(prog)
    try:
        return int(main(argv) or 0)
    finally:
        if saved is None:
            sys.argv.pop(0)
        else:
            sys.argv[0] = saved


def cmd_bench(args) -> int:
    prog = f"mla-multi bench {args.phase}"
    if args.phase.startswith("sparse-"):
        from mla_multi.benchmarks import sparse

        return _run_module_main(prog, lambda argv: sparse.main(argv, phase=args.phase.replace("-", "_")), args.rest)
    module = importlib.import_module(f"mla_multi.benchmarks.{args.phase}")
    return _run_module_main(prog, module.main, args.rest)


def cmd_compile_check(args) -> int:
    from mla_multi import compile_check

    return _run_module_main("mla-multi compile-check", compile_check.main, args.rest)


def _version() -> str:
    try:
        return importlib.metadata.version("mla-multi")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mla-multi", description="MLA attention for AMD and NVIDIA GPUs")
    parser.add_argument("--version", action="version", version=f"mla-multi {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="platform, backends per phase with their reasons, overrides, versions")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument("--as", dest="as_spec", metavar="SPEC",
                      help="show the selection on another device: a name (MI300X, MI355X, H100, A100, B200, ...) "
                           "or an arch (gfx942, gfx950, sm_80, sm_90, sm_100, ...)")
    info.set_defaults(func=cmd_info)
    demo = sub.add_parser("demo", help="run a DeepSeek-V3-shaped MLA layer through the paged cache and check it")
    demo.add_argument("--num-heads", type=_positive_int, default=None,
                      help="heads (default 128 on a GPU, 16 on the CPU)")
    demo.add_argument("--workspace-tokens", type=_positive_int, default=256, help="context tokens gathered per chunk")
    demo.add_argument("--sparse", action="store_true",
                      help="a sparse layer (DeepSeek-V3.2: top-k positions, the fp8_ds_mla cache) instead")
    demo.add_argument("--v4", nargs="?", const="584", choices=tuple(_V4_DEMO_FORMATS), default=None,
                      help="a DeepSeek-V4 layer (MLAAttentionV4: d 512, top-k + a 128-token window, a sink) "
                           "instead; its caches: 584 (fp8_ds_mla_v4, the default), 528 (fp8_ds_mla_v41) or "
                           "528+288 (V4.1 with an FP4 window)")
    demo.set_defaults(func=cmd_demo)
    warmup = sub.add_parser("warmup", help="build the kernels of one layer configuration ahead of serving")
    warmup.add_argument("--num-heads", type=_positive_int, default=128)
    warmup.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="model dtype on a GPU")
    warmup.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e4m3 | bfloat16 | float16")
    warmup.add_argument("--block-size", type=_positive_int, default=64)
    warmup.set_defaults(func=cmd_warmup)
    bench = sub.add_parser("bench", help="benchmarks on the GPU: decode, prefill, dcp (decode context parallelism), "
                           "layer, sparse-decode or sparse-prefill (--format v32 or v4)",
                           description="GPU benchmarks; `mla-multi bench PHASE --help` lists each one's options.")
    bench.add_argument("phase", choices=_BENCH_PHASES, metavar="PHASE",
                       help="one of: " + ", ".join(_BENCH_PHASES) + " (its options follow it)")
    bench.set_defaults(func=cmd_bench, rest=[])
    sub.add_parser("compile-check", help="compile every Triton kernel ahead of time for AMD and NVIDIA targets",
                   add_help=False).set_defaults(func=cmd_compile_check, rest=[])
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}; accepted: an integer of 1 or more")
    return value


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that report a user's mistake (a bad value, name, spec or configuration), not a bug."""
    from mla_multi.envs import EnvironmentValueError
    from mla_multi.registry import NoBackendError, UnknownBackendError

    return (UsageError, EnvironmentValueError, UnknownBackendError, NoBackendError, ValueError)


def main(argv: list[str] | None = None) -> int:
    """Run the command; a user's mistake is one line on stderr (`mla-multi CMD: error: ...`) and status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    try:
        # bench and compile-check hand their own options to their modules untouched
        # (argparse's REMAINDER would stop at the first "--option").
        if command == "compile-check":
            return cmd_compile_check(argparse.Namespace(rest=argv[1:]))
        if command == "bench" and len(argv) > 1 and argv[1] in _BENCH_PHASES:
            command = f"bench {argv[1]}"
            return cmd_bench(argparse.Namespace(phase=argv[1], rest=argv[2:]))
        args = build_parser().parse_args(argv)
        return args.func(args)
    except _user_errors() as error:
        import logging

        if logging.getLogger("mla_multi").isEnabledFor(logging.DEBUG):
            import traceback

            traceback.print_exc()
        message = str(error).strip() or type(error).__name__
        print(f"mla-multi{' ' + command if command else ''}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
