"""The sm_90 prefill kernel (`mla_multi.kernels.prefill_wgmma`, FlashAttention-3's structure in Gluon):
where it runs (CPU, impersonated devices), its compile specs, and on an H100 / H200 its results against
float64 (varlen with empty and one-token sequences, causal and not, with context, the rotary key inside
K or apart, NaN-poisoned outputs) and bad boundaries."""

from __future__ import annotations

import pytest
import torch
from test_kernels_prefill import assert_matches_float64, gpu_case

from mla_multi.kernels import prefill_wgmma
from mla_multi.platforms import SPECS


@pytest.mark.parametrize("device,reason", [("H100", ""), ("H200", ""), ("A100", "sm_90"), ("B200", "sm_90"),
                                           ("MI300X", "sm_90"), ("MI355X", "sm_90")])
def test_reason_names_the_devices_it_serves(device, reason):
    available, why = prefill_wgmma.gluon_available()
    platform = SPECS[device]
    text = prefill_wgmma.wgmma_prefill_reason(platform, torch.bfloat16, 192, 128)
    if not available:
        assert text == why
    elif reason:
        assert reason in text
    else:
        assert text == ""
        assert "dtype" in prefill_wgmma.wgmma_prefill_reason(platform, torch.float32, 192, 128)
        assert "head dims" in prefill_wgmma.wgmma_prefill_reason(platform, torch.bfloat16, 128, 128)
        assert len(prefill_wgmma.compile_specs(platform)) == 16
    if device not in ("H100", "H200"):
        assert prefill_wgmma.compile_specs(platform) == []


def _gpu_sm90() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("prefix", [0, 333], ids=["self", "with-context"])
@pytest.mark.parametrize("split", [False, True], ids=["joined-key", "split-key"])
@pytest.mark.parametrize("schedule", ["dynamic", "fixed", "per-item"])
def test_wgmma_prefill_matches_float64(num_heads, causal, prefix, split, schedule):
    """Every launch: one program per SM taking items from the launch's counter or walking them in a fixed
    order (at 128 heads many items a program, the K / V ring and the query tile's barriers running on across
    items), and one program per item."""
    q, k, v, extra, cu_q, cu_k, qlens, klens, out, lse = gpu_case(num_heads, prefix, split,
                                                                   num_heads * 7 + causal + prefix + split)
    scale = 192**-0.5
    prefill_wgmma.varlen_attention_wgmma(
        q, k[:, :, :128] if split else k, v, cu_q, cu_k, max(qlens), max(klens), scale, causal=causal, out=out,
        lse=lse, persistent=schedule != "per-item", dynamic=schedule == "dynamic", **extra,
    )
    torch.cuda.synchronize()
    assert_matches_float64(out, lse, q, k, v, cu_q, cu_k, scale, causal)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("num_heads", [1, 3, 20, 124, 132])
@pytest.mark.parametrize("schedule", ["dynamic", "fixed", "per-item"])
def test_wgmma_prefill_takes_head_counts_off_sixteen(num_heads, schedule):
    """Head counts that are not multiples of 16 (a layer takes any; tensor parallelism divides 128 heads by
    other counts too): against float64, every poisoned row written."""
    q, k, v, extra, cu_q, cu_k, qlens, klens, out, lse = gpu_case(num_heads, 0, True, 11 * num_heads)
    scale = 192**-0.5
    prefill_wgmma.varlen_attention_wgmma(
        q, k[:, :, :128], v, cu_q, cu_k, max(qlens), max(klens), scale, causal=True, out=out, lse=lse,
        persistent=schedule != "per-item", dynamic=schedule == "dynamic", **extra,
    )
    torch.cuda.synchronize()
    assert_matches_float64(out, lse, q, k, v, cu_q, cu_k, scale, True)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("cu_q,max_q", [
    ([0, 150, 400], 250), ([5, 150, 400], 250), ([0, 150, 140], 250), ([0, 150, 460], 310), ([0, -3, 400], 403),
    ([0, 150, 400], 200),
], ids=["valid", "not-from-zero", "decreasing", "past-tokens", "negative", "max-seqlen-too-small"])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-item"])
def test_wgmma_prefill_bad_boundaries_match_the_triton_kernel(cu_q, max_q, persistent):
    """Bad boundaries: the same NaN rows (output and LSE), the same error bit and the same good rows as the
    Triton kernel's; nothing written outside the tensors (poisoned margins stay)."""
    from mla_multi.kernels.launch_config import prefill_config
    from mla_multi.kernels.prefill import varlen_attention
    from mla_multi.platforms import current_platform

    device, tokens, heads = "cuda", 400, 16
    torch.manual_seed(3)
    q = torch.randn(tokens, heads, 192, device=device, dtype=torch.bfloat16)
    k = torch.randn(tokens, heads, 192, device=device, dtype=torch.bfloat16)
    v = torch.randn(tokens, heads, 128, device=device, dtype=torch.bfloat16)
    cu = torch.tensor(cu_q, dtype=torch.int32, device=device)
    results = []
    for kernel in ("triton", "wgmma"):
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        out = torch.full((tokens + 8, heads, 128), 7.0, device=device, dtype=torch.bfloat16)
        lse = torch.full((heads, tokens + 8), 7.0, device=device, dtype=torch.float32)
        args = (q, k, v, cu, cu, max_q, max_q, 0.07)
        if kernel == "triton":
            config = prefill_config(current_platform(), 192, 128, torch.bfloat16, True)
            varlen_attention(*args, causal=True, out=out[:tokens], lse=lse[:, :tokens], error_flag=flag, config=config)
        else:
            prefill_wgmma.varlen_attention_wgmma(*args, causal=True, out=out[:tokens], lse=lse[:, :tokens],
                                                 error_flag=flag, persistent=persistent)
        torch.cuda.synchronize()
        assert (out[tokens:] == 7.0).all() and (lse[:, tokens:] == 7.0).all()  # the margins
        results.append((int(flag.item()), out[:tokens].float(), lse[:, :tokens]))
    (flag_t, out_t, lse_t), (flag_w, out_w, lse_w) = results
    assert flag_t == flag_w
    assert torch.equal(out_t.isnan(), out_w.isnan()) and torch.equal(lse_t.isnan(), lse_w.isnan())
    written = (out_t != 7.0) & ~out_t.isnan()
    assert torch.equal(written, (out_w != 7.0) & ~out_w.isnan())
    if written.any():
        error = ((out_w[written] - out_t[written]).norm() / out_t[written].norm()).item()
        assert error < 1e-2, error


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("split", [False, True], ids=["joined-key", "split-key"])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-item"])
def test_wgmma_prefill_merges_a_chunk_into_the_output(split, persistent):
    """merge=True (the chunked prefill's context chunks): a non-causal result over keys B merged in place into
    (out, lse) over keys A equals attention over A and B together (float64); a sequence with no key on
    either side keeps 0 and -inf; one with keys on one side only keeps that side."""
    from test_kernels_prefill import _compare, _cu, _reference

    from mla_multi.kernels.prefill import varlen_attention

    device, dtype, heads = "cuda", torch.bfloat16, 16
    torch.manual_seed(11 + split)
    qlens, a_lens, b_lens = [300, 0, 129, 1000, 64], [200, 50, 0, 700, 0], [333, 0, 20, 128, 0]
    q = torch.randn(sum(qlens), heads, 192, device=device, dtype=dtype)
    k_a = torch.randn(sum(a_lens), heads, 192, device=device, dtype=dtype)
    v_a = torch.randn(sum(a_lens), heads, 128, device=device, dtype=dtype)
    k_b = torch.randn(sum(b_lens), heads, 192, device=device, dtype=dtype)
    v_b = torch.randn(sum(b_lens), heads, 128, device=device, dtype=dtype)
    extra = {}
    if split:  # one rotary key for every head, passed apart
        k_pe = torch.randn(sum(b_lens), 64, device=device, dtype=dtype)
        k_b[:, :, 128:] = k_pe[:, None, :]
        extra = {"k_pe": k_pe}
    cu_q, cu_a, cu_b = _cu(qlens, device), _cu(a_lens, device), _cu(b_lens, device)
    scale = 192**-0.5
    out, lse = varlen_attention(q, k_a, v_a, cu_q, cu_a, max(qlens), max(a_lens), scale, causal=False)
    prefill_wgmma.varlen_attention_wgmma(
        q, k_b[:, :, :128] if split else k_b, v_b, cu_q, cu_b, max(qlens), max(b_lens), scale, causal=False,
        out=out, lse=lse, merge=True, persistent=persistent, **extra,
    )
    torch.cuda.synchronize()
    starts_a, starts_b = cu_a.tolist(), cu_b.tolist()
    k_all = torch.cat([torch.cat([k_a[starts_a[i]:starts_a[i + 1]], k_b[starts_b[i]:starts_b[i + 1]]])
                       for i in range(len(qlens))])
    v_all = torch.cat([torch.cat([v_a[starts_a[i]:starts_a[i + 1]], v_b[starts_b[i]:starts_b[i + 1]]])
                       for i in range(len(qlens))])
    all_lens = [a + b for a, b in zip(a_lens, b_lens)]
    ref_out, ref_lse = _reference(q, k_all, v_all, cu_q, _cu(all_lens, device), scale, False, head_chunk=4)
    result = _compare(out, lse, ref_out, ref_lse)
    assert not result["out_nan"] and not result["lse_nan"], result
    assert result["out_err"] <= 1e-2 and result["lse_err"] <= 2e-2, result
    assert result["inf_pattern_ok"] and result["empty_rows_zero"], result


def test_takes_only_rows_of_heads_on_16_byte_boundaries():
    """The layouts `takes` (the default launch's choice) accepts: each token's heads side by side in its row;
    CPU tensors stand in for the GPU's here, and are themselves never launched."""
    from mla_multi.kernels.prefill_wgmma import _rows_of_heads

    q = torch.empty(300, 16, 256)[:, :, :192]
    assert _rows_of_heads(q) and _rows_of_heads(torch.empty(300, 64))
    assert not _rows_of_heads(torch.empty(16, 300, 192).transpose(0, 1))  # heads outermost: rows overlap
    assert not _rows_of_heads(torch.empty(300, 192, 16).transpose(1, 2)[:, :, :192][:, :, :100].contiguous()
                              .as_strided((300, 16, 100), (1600, 50, 1)))  # heads overlap
    assert not prefill_wgmma.takes(q, q, q[:, :, :128], None, SPECS["H100"])  # a CPU tensor is not launched


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_sm90(), reason="needs an sm_90 GPU")
def test_default_launch_binds_once_and_follows_new_lengths(monkeypatch):
    """`prefill.varlen_attention`'s default launch on sm_90: the first call of a specialisation binds the
    kernel; later calls with the same layouts launch it directly (Triton's dispatch is not entered: it raises
    here), with new sequence lengths (a new grid and new integer arguments) and new output buffers; every
    call matches float64."""
    from test_kernels_prefill import _cu

    from mla_multi.kernels.prefill import varlen_attention

    prefill_wgmma._LAUNCHES.clear()
    device, dtype, heads, scale = "cuda", torch.bfloat16, 16, 192**-0.5
    torch.manual_seed(5)
    q = torch.randn(1024, heads, 192, device=device, dtype=dtype)
    k = torch.randn(1024, heads, 192, device=device, dtype=dtype)
    v = torch.randn(1024, heads, 128, device=device, dtype=dtype)
    cases = ([1024], [512, 512], [700, 1, 0, 323], [128] * 8)
    for round in range(2):
        if round == 1:
            def dispatch(*args, **kwargs):
                raise AssertionError("Triton's dispatch entered after the kernel was bound")
            monkeypatch.setattr(prefill_wgmma._prefill_wgmma_kernel, "run", dispatch)
        for lengths in cases:
            cu = _cu(lengths, device)
            out = torch.full((1024, heads, 128), float("nan"), device=device, dtype=dtype)
            lse = torch.full((heads, 1024), float("nan"), device=device, dtype=torch.float32)
            varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), scale, causal=True, out=out, lse=lse,
                             return_lse=True)
            torch.cuda.synchronize()
            assert_matches_float64(out, lse, q, k, v, cu, cu, scale, True)
    assert prefill_wgmma._LAUNCHES and all(bound._run is not None for bound in prefill_wgmma._LAUNCHES.values())


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("band", [1, 8, 5])
def test_dynamic_schedule_matches_the_fixed_order_on_streams_and_in_a_graph(band):
    """The dynamic schedule computes every item exactly as the fixed order does (the same bits), in bands of
    any width (5: bands that do not divide the 128 heads); its counter is back at 0 after each launch; a
    second stream gets a counter of its own; a launch captured in a CUDA graph on that stream replays with new
    data, and eager launches on the first stream between the replays keep their results."""
    from test_kernels_prefill import _cu

    device, dtype, heads, scale = "cuda", torch.bfloat16, 128, 192**-0.5
    torch.manual_seed(17 + band)
    lengths = [512, 1, 0, 300, 129, 512]
    total = sum(lengths)
    cu = _cu(lengths, device)
    q = torch.randn(total, heads, 192, device=device, dtype=dtype)
    k = torch.randn(total, heads, 192, device=device, dtype=dtype)
    v = torch.randn(total, heads, 128, device=device, dtype=dtype)

    def run(dynamic, out_value=float("nan")):
        out = torch.full((total, heads, 128), out_value, device=device, dtype=dtype)
        lse = torch.full((heads, total), out_value, device=device, dtype=torch.float32)
        prefill_wgmma.varlen_attention_wgmma(q, k, v, cu, cu, 512, 512, scale, causal=True, out=out, lse=lse,
                                             persistent=True, dynamic=dynamic, band=band)
        return out, lse

    fixed_out, fixed_lse = run(False)
    assert_matches_float64(fixed_out, fixed_lse, q, k, v, cu, cu, scale, True)
    for _ in range(3):
        out, lse = run(True)
        torch.cuda.synchronize()
        assert torch.equal(out, fixed_out) and torch.equal(lse.nan_to_num(), fixed_lse.nan_to_num())
    counter = prefill_wgmma._schedule_counter(q.device)
    assert counter is not None and counter.tolist() == [0, 0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        side_counter = prefill_wgmma._schedule_counter(q.device)
        assert side_counter.data_ptr() != counter.data_ptr()
        out, lse = run(True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(out, fixed_out)

    static_out = torch.empty((total, heads, 128), device=device, dtype=dtype)
    static_lse = torch.empty((heads, total), device=device, dtype=torch.float32)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefill_wgmma.varlen_attention_wgmma(q, k, v, cu, cu, 512, 512, scale, causal=True, out=static_out,
                                             lse=static_lse, persistent=True, band=band)
    for step in range(3):
        q.copy_(torch.randn_like(q))
        static_out.fill_(float("nan"))
        graph.replay()
        eager_out, eager_lse = run(True)
        torch.cuda.synchronize()
        assert_matches_float64(static_out, static_lse, q, k, v, cu, cu, scale, True)
        assert torch.equal(static_out, eager_out)
        assert prefill_wgmma._schedule_counter(q.device).tolist() == [0, 0]


def test_schedule_policy_and_band_arguments():
    """The default launch's schedule: the fixed order for batches of equal sequences up to
    PERSISTENT_MAX_SEQLEN_Q, dynamic elsewhere (ragged, longer, keys of other lengths); causal bands hold
    BAND_ROUNDS rounds of the grid within BAND_KV_BYTES, non-causal bands one pair; the band arguments put
    the pairs that do not fill a band first."""
    limit = prefill_wgmma.PERSISTENT_MAX_SEQLEN_Q
    assert not prefill_wgmma.takes_dynamic(16 * 512, 16 * 512, 16, 512, 512)
    assert not prefill_wgmma.takes_dynamic(2 * limit, 2 * limit, 2, limit, limit)
    assert prefill_wgmma.takes_dynamic(16 * 512 - 1, 16 * 512 - 1, 16, 512, 512)  # one shorter sequence
    assert prefill_wgmma.takes_dynamic(16 * 512, 16 * 4096, 16, 512, 4096 + 1)  # keys of other lengths
    assert prefill_wgmma.takes_dynamic(limit + 128, limit + 128, 1, limit + 128, limit + 128)
    assert prefill_wgmma.band_of(132, 4, 512, True) == 66
    assert prefill_wgmma.band_of(132, 16, 2048, True) == 17
    assert prefill_wgmma.band_of(132, 64, 8192, True) == 5
    assert prefill_wgmma.band_of(132, 4, 512, False) == 1
    # K and V of a band within the bound: 66 pairs of 512 keys fit, of 65536 keys one pair
    assert prefill_wgmma.band_of(132, 1, 65536, True) == 1
    assert prefill_wgmma.band_of(132, 1, 4096, True) == prefill_wgmma.BAND_KV_BYTES // (4096 * 512)
    assert prefill_wgmma.band_arguments(66, 2048, 4) == (66, 2, 8, 264)
    assert prefill_wgmma.band_arguments(1, 2048, 4) == (1, 0, 0, 4)
    assert prefill_wgmma.band_arguments(5, 16, 64) == (5, 1, 64, 320)
