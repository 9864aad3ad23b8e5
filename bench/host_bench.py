"""Eager and graph-replayed time of the decode op and of a layer's decode step, beside FlashMLA and FlashInfer
(its wrapper.run, planned outside, and the op's FLASHINFER backend) where they are installed; the shared workspace of 61 layers; a layer's forward under the sync debug mode.

    PYTHONPATH=. python3 bench/host_bench.py [--op-only | --mixed-only]

Eager: `triton.testing.do_bench` of the plain call (the host path included), median; the op's eager time and
each peer's alternate three times, the best of each kept (a shared host's noise); a layer step's eager time is
the best of three, printed beside FlashMLA's own eager call's excess over its captured one (the host's speed). Captured: one CUDA graph
of 20 calls replayed, median per call. Working set over L2: every case reads at least 128 MiB of cache.
"""
import torch

import mla_multi as mm
from mla_multi.benchmarks import eager_time, graph_time, host_time

dev = "cuda"
BS = 64
torch.manual_seed(0)
try:
    import flash_mla
except Exception:  # noqa: BLE001
    flash_mla = None
try:
    from mla_multi.backends.flashinfer import FlashInferDecodeBackend

    FLASHINFER = not FlashInferDecodeBackend.availability_reasons()
except Exception:  # noqa: BLE001
    FLASHINFER = False




def busy_eager(fn, calls=50):
    """Per-call time of `calls` eager calls queued behind 5 ms of other GPU work (host overlaps the GPU)."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        for _ in range(12):
            a @ a  # ~5 ms of earlier work
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


import sys

MIXED_ONLY = "--mixed-only" in sys.argv
flashmla_gap = None  # FlashMLA's own eager call over its captured one at N=128 B=1 S=8192, where it ran
print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
print("decode op (bf16, block 64): eager / captured us; FlashMLA eager / captured")
scale = 192**-0.5
for n, b, s in () if MIXED_ONLY else ((16, 1, 8192), (128, 1, 8192), (16, 8, 8192), (128, 8, 8192), (128, 32, 8192), (16, 64, 8192),
                (64, 64, 8192), (128, 1, 32768)):
    copies = max(1, (128 << 20) // (b * s * 576 * 2))
    nb = b * s // BS
    caches = [torch.randn(nb, BS, 576, device=dev, dtype=torch.bfloat16) for _ in range(min(copies, 4))]
    bt = torch.randperm(nb, device=dev).int().reshape(b, s // BS)
    sl = torch.full((b,), s, dtype=torch.int32, device=dev)
    qn = torch.randn(b, n, 512, device=dev, dtype=torch.bfloat16)
    qp = torch.randn(b, n, 64, device=dev, dtype=torch.bfloat16)
    state = {"i": 0}

    def ours():
        state["i"] = (state["i"] + 1) % len(caches)
        return mm.ops.mla_decode(qn, qp, caches[state["i"]], bt, sl, scale)

    e, c, busy = eager_time(ours), graph_time(ours), busy_eager(ours)
    line = f"N={n:3d} B={b:3d} S={s:5d}  ours {e:7.1f} / {c:7.1f} (busy GPU: {busy:7.1f})"
    if flash_mla is not None:
        q = torch.cat([qn, qp], -1).unsqueeze(1)
        meta = flash_mla.get_mla_metadata()[0]

        def theirs():
            state["i"] = (state["i"] + 1) % len(caches)
            return flash_mla.flash_mla_with_kvcache(q, caches[state["i"]].view(-1, BS, 1, 576), bt, sl, 512, meta,
                                                    softmax_scale=scale, use_legacy=True)[0]

        try:
            # ours and FlashMLA's eager times alternate three times, each side's best kept (a shared host's noise)
            fe, fc = eager_time(theirs), graph_time(theirs)
            for _ in range(2):
                e = min(e, eager_time(ours))
                fe = min(fe, eager_time(theirs))
            ref = theirs().squeeze(1)
            state["i"] -= 1
            err = ((ours().float() - ref.float()).norm() / ref.float().norm()).item()
            line += f"  FlashMLA {fe:7.1f} / {fc:7.1f}  eager ratio {e / fe:5.2f}  diff {err:.1e}"
            if (n, b, s) == (128, 1, 8192):
                flashmla_gap = fe - fc  # the host's speed beside the layer step's eager gap below
        except Exception as error:  # noqa: BLE001
            line += f"  FlashMLA failed: {type(error).__name__}: {str(error)[:100]}"
    if FLASHINFER:
        # FlashInfer's own wrapper.run, its plan made once outside the timing (through the package's planner)
        from mla_multi.backends.flashinfer import FlashInferDecodeImpl

        impl = FlashInferDecodeImpl(n, scale, 512, 64, torch.bfloat16, BS, torch.device(dev))
        fi_plan = impl.plan(sl.cpu(), bt)

        def flashinfer_run():
            state["i"] = (state["i"] + 1) % len(caches)
            return fi_plan.wrapper.run(query=(qn, qp), kv_cache=caches[state["i"]], return_lse=True,
                                       return_lse_base_on_e=True)[0]

        def ours_flashinfer():
            state["i"] = (state["i"] + 1) % len(caches)
            return mm.ops.mla_decode(qn, qp, caches[state["i"]], bt, sl, scale, backend="FLASHINFER")

        try:
            # the two eager times alternate three times, each side's best kept: a shared host's noise
            # (tens of µs between identical medians) would otherwise decide the ratio
            raw, ours_fi = float("inf"), float("inf")
            for _ in range(3):
                raw = min(raw, eager_time(flashinfer_run))
                ours_fi = min(ours_fi, eager_time(ours_flashinfer))
                e = min(e, eager_time(ours))
            line += f"  FlashInfer eager {raw:7.1f} (ours / FlashInfer {e / raw:4.2f})"
            try:
                line += f" / {graph_time(flashinfer_run):7.1f}"
            except Exception as error:  # noqa: BLE001
                line += f" (not captured: {type(error).__name__})"
            line += f"; backend FLASHINFER eager {ours_fi:7.1f} ({ours_fi / raw:4.2f}x)"
        except Exception as error:  # noqa: BLE001
            line += f"  FlashInfer failed: {type(error).__name__}: {str(error)[:100]}"
    print(line, flush=True)
    if (n, b) == (128, 1):
        parts = f"host per call: ours {host_time(ours):.1f} us"
        if flash_mla is not None:
            parts += f", FlashMLA {host_time(theirs):.1f} us"
        print("    " + parts, flush=True)

if "--op-only" in sys.argv:
    sys.exit(0)
print("layer decode step, N=128 (plan outside): eager (best of three) / captured us")
dims = mm.MLADims.deepseek_v3(num_heads=128)
weight = (torch.randn(128 * 256, 512, device=dev) / 512**0.5).to(torch.bfloat16)
for b, s in () if MIXED_ONLY else ((1, 8192), (64, 4096), (128, 4096)):
    layer = mm.MLAAttention(dims, scale, weight, block_size=BS, max_model_len=8192, max_num_seqs=128)
    nb = b * s // BS + 1
    cache = torch.randn(nb, BS, 576, device=dev, dtype=torch.bfloat16)
    bt = torch.randperm(nb, device=dev)[: b * (s // BS)].int().reshape(b, s // BS)
    md = mm.CommonAttentionMetadata.from_lengths([1] * b, [s] * b, bt, BS)
    q = torch.randn(b, 128, 192, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(b, 512, device=dev, dtype=torch.bfloat16)
    kpe = torch.randn(b, 64, device=dev, dtype=torch.bfloat16)
    out = torch.empty(b, 128 * 128, device=dev, dtype=torch.bfloat16)
    layer.plan(md)

    def step():
        return layer.forward(q, kv, kpe, cache, md, output=out)

    # the best of three eager measurements, as the op rows above take (a shared host's noise: one median of the
    # same step swung 42 to 142 µs between processes of one device call)
    e = min(eager_time(step) for _ in range(3))
    layer.lock_workspace()
    c = graph_time(step)
    layer.workspace.unlock()
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        step()
        sync = "no sync"
    except Exception as error:  # noqa: BLE001
        sync = f"SYNC: {str(error)[:120]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host_speed = "" if flashmla_gap is None else f"; FlashMLA's own eager call + {flashmla_gap:.1f} over its captured one"
    print(f"B={b:3d} S={s:5d}  eager {e:7.1f}  captured {c:7.1f}  eager - captured {e - c:6.1f}  ({sync}{host_speed})",
          flush=True)

print("61 layers of DeepSeek-V3, max_num_seqs 256, max_model_len 32768 (workspace beyond the weights)")
for heads in () if MIXED_ONLY else (16, 128):
    mm.workspace.set_workspace_manager(None, dev)
    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    weight = torch.randn(heads * 256, 512, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    one = mm.MLAAttention(dims, scale, weight, block_size=BS, max_model_len=32768, max_num_seqs=256)
    after_one = torch.cuda.memory_allocated() - base
    layers = [one] + [mm.MLAAttention(dims, scale, weight, block_size=BS, max_model_len=32768, max_num_seqs=256)
                      for _ in range(60)]
    after_all = torch.cuda.memory_allocated() - base
    # the layers share `weight`, allocated before `base`; W_UK / W_UV are views of it: no per-layer weights
    weights = 0
    print(f"heads {heads:3d}: one layer {after_one / 2**20:8.1f} MiB (weights {weights / 61 / 2**20:.1f}), "
          f"61 layers {after_all / 2**20:8.1f} MiB, 61 layers minus their weights "
          f"{(after_all - weights) / 2**20:8.1f} MiB, workspace {layers[0].workspace.size_bytes / 2**20:.1f} MiB")
    del layers, one


def mixed_step_peak(prefill_backend=None, split_key=True, decode_backend=None, workspace_tokens=None):
    """The peak memory of one mixed step beyond the shared workspace and the step's tensors (split_key=False:
    the rotary key repeated per head even where the prefill backend takes it apart)."""
    print("mixed step peak: 64 decodes + 16 prefills x 512 new tokens with 3584 cached, N=16, 61-layer reservation, "
          f"prefill {prefill_backend or 'chosen by the registry'}, decode {decode_backend or 'chosen by the registry'}, "
          f"workspace_tokens {workspace_tokens or 'default'}")
    mm.workspace.set_workspace_manager(None, dev)
    heads = 16
    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    weight = (torch.randn(heads * 256, 512, device=dev) / 512**0.5).to(torch.bfloat16)
    layer = mm.MLAAttention(dims, scale, weight, block_size=BS, max_model_len=32768, max_num_seqs=256,
                            prefill_backend=prefill_backend, decode_backend=decode_backend,
                            workspace_tokens=workspace_tokens)
    if not split_key:
        layer.prefill_impl.__dict__["takes_split_key"] = False
    print(f"  prefill {layer.prefill_backend.name}, rotary key apart: {getattr(layer.prefill_impl, 'takes_split_key', False)}")
    query_lens = [1] * 64 + [512] * 16
    seq_lens = [4096] * 64 + [4096] * 16
    blocks = 4096 // BS
    nb = len(seq_lens) * blocks
    cache = torch.randn(nb, BS, 576, device=dev, dtype=torch.bfloat16)
    bt = torch.randperm(nb, device=dev).int().reshape(len(seq_lens), blocks)
    md = mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, bt, BS)
    t = sum(query_lens)
    q = torch.randn(t, heads, 192, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(t, 512, device=dev, dtype=torch.bfloat16)
    kpe = torch.randn(t, 64, device=dev, dtype=torch.bfloat16)
    out = torch.empty(t, heads * 128, device=dev, dtype=torch.bfloat16)
    layer.plan(md)
    layer.forward(q, kv, kpe, cache, md, output=out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    layer.forward(q, kv, kpe, cache, md, output=out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    chunk = layer.workspace_tokens
    bound = min(chunk, 16 * 3584) * heads * (128 + 128) * 2
    print(f"workspace {layer.workspace.size_bytes / 2**20:.1f} MiB reserved; step peak beyond it and the step's tensors "
          f"{peak / 2**20:.1f} MiB; one chunk's up-projected K and V (tokens x N x (P + V), bf16) {bound / 2**20:.1f} MiB; "
          f"chunks {md.backend_plans and [p for k, p in md.backend_plans.items() if isinstance(k, tuple) and k[0] == 'prefill_metadata'][0].chunked_context.num_chunks}")
    e = eager_time(lambda: layer.forward(q, kv, kpe, cache, md, output=out))
    print(f"mixed step eager {e:.1f} us")


for split_key in (True, False) if MIXED_ONLY else (True,):
    mixed_step_peak(None, split_key)
if FLASHINFER:  # FlashInfer's float workspace inside the shared one, both phases through it
    mixed_step_peak("FLASHINFER", True, "FLASHINFER")
    for backend in (None, "FLASHINFER"):  # full chunks: the context (57344 tokens) over workspace_tokens
        mixed_step_peak(backend, True, backend, workspace_tokens=32768)
if flash_mla is not None:  # FlashMLA's decode allocates its results and split partials itself, in each call
    mixed_step_peak(None, True, "FLASHMLA")
