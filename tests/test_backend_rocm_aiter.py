"""ROCM_AITER on the CPU: the adapter against a PyTorch stand-in of aiter
v0.1.20.post1 (tests/fake_aiter: its kernel tables, persistent metadata and
one-split paths), and backend selection on impersonated MI300X / MI355X.

The contract with aiter's source is tests/test_backend_rocm_aiter_contract.py.
The wheel the package index serves (amd-aiter 0.1.7, about 40 MB, `pip
download --no-deps` into the pytest cache, or MLA_MULTI_AITER_WHEEL) is read
with `ast` to show that an aiter without the persistent path is declined.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import os
import pathlib
import sys
import zipfile

import pytest
import torch
from published import adapter_keywords, published_distribution, published_parameters

from mla_multi.backends import rocm_aiter
from mla_multi.backends.base import DecodeSelectorConfig, PrefillSelectorConfig, dtype_name
from mla_multi.backends.reference import mla_decode_reference, varlen_attention_reference
from mla_multi.dims import MLADims
from mla_multi.platforms import SPECS, override
from mla_multi.registry import NoBackendError, Registry
from mla_multi.testing import relative_error
from mla_multi.workspace import WorkspaceManager

AITER_PUBLISHED = os.environ.get("MLA_MULTI_AITER_SPEC", "amd-aiter==0.1.7.post2.dev18")  # the index's only wheel
FAKE_AITER = pathlib.Path(__file__).parent / "fake_aiter"
ADAPTER_SOURCE = pathlib.Path(rocm_aiter.__file__)


# --------------------------------------------------------------------------- published source


@pytest.fixture(scope="session")
def aiter_wheel(pytestconfig) -> pathlib.Path:
    """The amd-aiter wheel the package index serves (0.1.7.post2.dev18): MLA_MULTI_AITER_WHEEL, or downloaded once."""
    return published_distribution(
        pytestconfig, AITER_PUBLISHED, "amd_aiter", ".whl", "MLA_MULTI_AITER_WHEEL", ("--only-binary", ":all:")
    )


def _published_function(wheel: pathlib.Path, source: str, function: str) -> ast.FunctionDef | None:
    with zipfile.ZipFile(wheel) as archive:
        if source not in archive.namelist():
            return None
        tree = ast.parse(archive.read(source).decode("utf-8"), filename=source)
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function]
    return found[-1] if found else None


def test_the_index_aiter_lacks_what_the_adapter_passes(aiter_wheel):
    """The index's wheel (aiter of 2025-11) has the persistent buffers but no page_size, nhead_kv, causal or
    return_lse: the adapter, which follows v0.1.20.post1 (tests/test_backend_rocm_aiter_contract.py), names the
    missing parameters as its reason there instead of calling it."""
    decode = _published_function(aiter_wheel, "aiter/mla.py", "mla_decode_fwd")
    names, _ = published_parameters(decode)
    if os.environ.get("MLA_MULTI_AITER_WHEEL") and "causal" in names:
        pytest.skip("MLA_MULTI_AITER_WHEEL names an aiter with the current signature")
    assert "work_meta_data" in names and "return_lse" not in names
    assert rocm_aiter._missing_keywords(rocm_aiter.MLA_DECODE_FWD, tuple(names)) == ["page_size", "nhead_kv", "causal"]


def test_published_aiter_ships_mla_kernels_for_gfx942_and_gfx950(aiter_wheel):
    with zipfile.ZipFile(aiter_wheel) as archive:
        archs = {name.split("/")[2] for name in archive.namelist()
                 if name.startswith("aiter_meta/hsa/") and "/mla/" in name and name.endswith(".co")}
    assert set(rocm_aiter.AITER_ARCHS) <= archs


# --------------------------------------------------------------------------- the stand-in aiter


def _forget_aiter() -> dict:
    return {name: sys.modules.pop(name) for name in list(sys.modules) if name == "aiter" or name.startswith("aiter.")}


@pytest.fixture
def aiter_on_path(monkeypatch):
    """Put a directory holding an `aiter` package first on sys.path; restore everything after."""
    saved = _forget_aiter()

    def install(directory: pathlib.Path) -> None:
        _forget_aiter()
        monkeypatch.syspath_prepend(str(directory))
        rocm_aiter.clear_probe_cache()

    yield install
    _forget_aiter()
    sys.modules.update(saved)
    rocm_aiter.clear_probe_cache()


@pytest.fixture
def fake_aiter(aiter_on_path):
    aiter_on_path(FAKE_AITER)
    import aiter.mla
    import aiter.ops.mha

    import aiter.ops.attention

    aiter.mla.CALLS.clear()
    aiter.ops.mha.CALLS.clear()
    aiter.ops.attention.CALLS.clear()
    return aiter


@pytest.fixture
def broken_aiter(aiter_on_path, tmp_path):
    package = tmp_path / "aiter"
    package.mkdir()
    (package / "__init__.py").write_text('raise RuntimeError("ROCm version file not found")\n')
    aiter_on_path(tmp_path)


@pytest.fixture
def missing_aiter(aiter_on_path, monkeypatch):
    aiter_on_path(FAKE_AITER.parent / "no-such-directory")
    monkeypatch.setitem(sys.modules, "aiter", None)  # import aiter -> ModuleNotFoundError
    rocm_aiter.clear_probe_cache()


def _expected_indices(block_table, seq_lens, block_size):
    rows = []
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows += [int(block_table[b, j // block_size]) * block_size + j % block_size for j in range(seq_len)]
    return rows


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_kv_indices_expand_block_tables(block_size):
    generator = torch.Generator().manual_seed(block_size)
    max_blocks = 5
    seq_lens = torch.tensor([0, 1, block_size * 3 + 1, block_size * max_blocks], dtype=torch.int32)
    block_table = torch.randperm(40, generator=generator)[: 4 * max_blocks].reshape(4, max_blocks).to(torch.int32)
    qo_indptr, kv_indptr, kv_indices, last = rocm_aiter.paged_kv_indices(block_table, seq_lens, block_size)
    assert qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert kv_indptr.tolist() == [0] + torch.cumsum(seq_lens, 0).tolist()
    assert last.tolist() == [1, 1, 1, 1]
    assert all(t.dtype == torch.int32 for t in (qo_indptr, kv_indptr, kv_indices, last))
    total = int(seq_lens.sum())
    assert kv_indices[:total].tolist() == _expected_indices(block_table, seq_lens, block_size)
    assert kv_indices.numel() == 4 * max_blocks * block_size
    assert (kv_indices[total:] == -1).all(), "past the valid tokens the list holds -1"


def test_paged_kv_indices_never_read_data_back():
    """Built on the meta device: any host read of the data (a sync on a GPU) would raise."""
    block_table = torch.empty(8, 12, dtype=torch.int32, device="meta")
    seq_lens = torch.empty(8, dtype=torch.int32, device="meta")
    qo_indptr, kv_indptr, kv_indices, last = rocm_aiter.paged_kv_indices(block_table, seq_lens, 16)
    assert kv_indices.shape == (8 * 12 * 16,) and kv_indptr.shape == (9,) and qo_indptr.shape == (9,)


def _decode_case(num_heads, block_size, seq_lens, kv_cache_dtype=torch.bfloat16, k_scale=None, seed=0, query_len=None):
    generator = torch.Generator().manual_seed(seed)
    lkv, rope = 512, 64
    batch = len(seq_lens)
    max_blocks = max(1, -(-max(seq_lens) // block_size))
    num_blocks = batch * max_blocks + 3
    shape = (batch, num_heads) if query_len is None else (batch, query_len, num_heads)
    q_nope = torch.randn(*shape, lkv, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(*shape, rope, generator=generator).to(torch.bfloat16)
    values = torch.randn(num_blocks, block_size, lkv + rope, generator=generator)
    if kv_cache_dtype == torch.bfloat16:
        kv_cache = values.to(torch.bfloat16)
    else:
        kv_cache = (values / k_scale).to(kv_cache_dtype)
    block_table = torch.randperm(num_blocks, generator=generator)[: batch * max_blocks].reshape(batch, max_blocks).to(torch.int32)
    return q_nope, q_pe, kv_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32)


def _decode_impl(num_heads, block_size, kv_cache_dtype=torch.bfloat16, scale=0.1):
    return rocm_aiter.AiterMLADecodeImpl(num_heads, scale, 512, 64, kv_cache_dtype, block_size)


ARCH = {"MI300X": "gfx942", "MI355X": "gfx950"}


def _check_against_reference(out, lse, q_nope, q_pe, kv_cache, block_table, seq_lens, scale, route, k_scale=None,
                             tolerance=1e-2):
    ref, ref_lse = mla_decode_reference(q_nope.double(), q_pe.double(),
                                        kv_cache if k_scale is not None else kv_cache.double(), block_table, seq_lens,
                                        scale, None if k_scale is None else k_scale.double())
    assert out.shape == q_nope.shape and out.dtype == torch.bfloat16
    assert relative_error(out, ref) < tolerance
    if route.lse:
        assert lse is not None and lse.shape == q_nope.shape[:-1] and lse.dtype == torch.float32
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), "empty rows are -inf, the others finite"
        assert relative_error(lse[finite], ref_lse[finite]) < (1e-3 if k_scale is None else 1e-2)
    else:
        assert lse is None, f"{route.describe()}: the kernel writes no LSE, none may be returned"


@pytest.mark.parametrize("platform", ["MI300X", "MI355X"])
@pytest.mark.parametrize("block_size", [1, 64])
@pytest.mark.parametrize("num_heads", [4, 8, 16, 20, 32, 48, 64, 128])
def test_decode_matches_reference(fake_aiter, platform, block_size, num_heads):
    seq_lens = [block_size * 2 + 3, 0, 1, 70]
    q_nope, q_pe, kv_cache, block_table, seq_lens_t = _decode_case(num_heads, block_size, seq_lens, seed=num_heads + block_size)
    scale = 0.0721
    with override(platform):
        impl = _decode_impl(num_heads, block_size, scale=scale)
        route = impl.route(1)
        out, lse = impl.forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens_t)
    _check_against_reference(out, lse, q_nope, q_pe, kv_cache, block_table, seq_lens_t, scale, route)
    assert not out[1].any(), "a request without tokens gives 0"
    call = fake_aiter.mla.CALLS[-1]
    # The scale is always passed (aiter's default 1/sqrt(576) is wrong for MLA).
    assert call["sm_scale"] == scale
    assert call["persistent"] == route.persistent and call["nhead"] == route.heads
    if route.persistent:
        assert call["num_kv_splits"] is None, "the persistent path's split count is aiter's"


@pytest.mark.parametrize("platform", ["MI300X", "MI355X"])
@pytest.mark.parametrize("query_len", [2, 3, 4])
@pytest.mark.parametrize("num_heads", [16, 32, 64, 128])
def test_multi_token_decode_matches_reference(fake_aiter, platform, query_len, num_heads):
    """MTP verification: Q query tokens a request, causal among themselves, token j sees seq_len - Q + 1 + j."""
    seq_lens = [40, 2, 0, 17]
    q_nope, q_pe, kv_cache, block_table, seq_lens_t = _decode_case(num_heads, 16, seq_lens, seed=query_len,
                                                                     query_len=query_len)
    with override(platform):
        impl = _decode_impl(num_heads, 16)
        route = impl.route(query_len)
        out, lse = impl.forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens_t)
    _check_against_reference(out, lse, q_nope, q_pe, kv_cache, block_table, seq_lens_t, 0.1, route)
    assert fake_aiter.mla.CALLS[-1]["max_seqlen_q"] == query_len


@pytest.mark.parametrize("platform", ["MI300X", "MI355X"])
@pytest.mark.parametrize("num_heads", [16, 64, 128])
def test_fp8_decode_quantises_the_query_and_passes_scales(fake_aiter, platform, num_heads):
    fp8 = SPECS[platform].fp8_dtype
    k_scale = torch.tensor([0.05])
    q_nope, q_pe, kv_cache, block_table, seq_lens = _decode_case(num_heads, 16, [40, 17, 64], fp8, k_scale)
    with override(platform):
        impl = _decode_impl(num_heads, 16, fp8)
        route = impl.route(1)
        out, lse = impl.forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale=k_scale)
        with pytest.raises(ValueError, match="k_scale"):
            impl.forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens)
    _check_against_reference(out, lse, q_nope, q_pe, kv_cache, block_table, seq_lens, 0.1, route, k_scale, 6e-2)
    assert fake_aiter.mla.CALLS[0]["q_dtype"] == fp8


# --------------------------------------------------------------------------- routes against the stand-in's model


def _fake_model():
    import aiter._model

    return aiter._model


ROUTE_HEADS = (1, 4, 8, 12, 16, 20, 24, 32, 40, 48, 64, 72, 80, 96, 112, 120, 128)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_every_route_has_the_kernel_the_stand_in_finds(fake_aiter, arch, kv):
    """The adapter's routes (its own reading of aiter's dispatch) against the stand-in's model of it: a route's
    kernel exists (persistent or not, with the LSE where the route asks for it), and a configuration without a
    route has no kernel at any head count the adapter could pad to."""
    model = _fake_model()
    kv_dtype = torch.bfloat16 if kv == "bf16" else (torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn)
    missing = []
    for num_heads in ROUTE_HEADS:
        for query_len in range(1, 9):
            route = rocm_aiter.aiter_decode_route(arch, num_heads, query_len, kv_dtype)
            if route is None:
                for heads in rocm_aiter._head_candidates(num_heads):
                    for persistent in (True, False):
                        with pytest.raises(model.AiterError):
                            model.decode_kernel(arch, kv, kv, heads, query_len, persistent, False)
                missing.append((num_heads, query_len))
                continue
            assert route.heads % 8 == 0 and route.heads >= num_heads and route.heads in rocm_aiter._head_candidates(num_heads)
            model.decode_kernel(arch, route.q_type, route.kv_type, route.heads, query_len, route.persistent, route.lse)
            if route.lse and not route.persistent:
                splits = model.non_persistent_splits(rocm_aiter.AITER_NON_PERSISTENT_SPLITS, 4, 4 * 1000, route.heads,
                                                     query_len, route.q_type)
                assert model.non_persistent_lse_written(splits, route.heads, query_len, route.q_type, route.kv_type)
    # longer MTP runs on gfx950's folds and gfx942's bf16 split-KV kernels; on gfx942 FP8 only 128 heads (72-120
    # padded to them) take more than 4 tokens
    if arch == "gfx950":
        assert [m for m in missing if m[1] <= 4] == []
    elif kv == "fp8":
        assert {m for m in missing if m[0] >= 16} == {(h, q) for h in ROUTE_HEADS if 16 <= h <= 64 for q in range(5, 9)}


# --------------------------------------------------------------------------- the LSE only where a kernel writes it

# (platform, heads, query tokens, cache, split count aiter is given): aiter's non-persistent one-split paths that
# hand back an LSE buffer they never wrote
ONE_SPLIT_HOLES = [
    pytest.param("MI300X", 128, 1, "bf16", id="128-heads-bf16-output-copied"),
    pytest.param("MI355X", 64, 1, "bf16", id="64-heads-bf16-output-copied"),
    pytest.param("MI300X", 32, 1, "bf16", id="32-heads-bf16-returns-early"),
    pytest.param("MI300X", 8, 1, "bf16", id="8-heads-bf16-returns-early"),
    pytest.param("MI300X", 16, 4, "bf16", id="4-tokens-bf16-returns-early"),
    pytest.param("MI300X", 16, 1, "fp8", id="fp8-returns-early"),
    pytest.param("MI355X", 128, 1, "fp8", id="128-heads-fp8-returns-early"),
]


@pytest.mark.parametrize("platform, num_heads, query_len, kv", ONE_SPLIT_HOLES)
def test_one_split_paths_leave_the_lse_unwritten(fake_aiter, platform, num_heads, query_len, kv):
    """The stand-in reproduces each hole (a NaN LSE), and the adapter never hands such an LSE on: it asks for the
    LSE only on a route whose kernel writes it, and on the split-KV path with at least two splits."""
    fp8 = SPECS[platform].fp8_dtype
    kv_dtype = torch.bfloat16 if kv == "bf16" else fp8
    k_scale = torch.tensor([0.05]) if kv == "fp8" else None
    q_nope, q_pe, kv_cache, block_table, seq_lens = _decode_case(num_heads, 16, [20, 9], kv_dtype, k_scale,
                                                                   query_len=query_len)
    rows = kv_cache.shape[0] * 16
    query = torch.cat([q_nope, q_pe], -1).reshape(-1, num_heads, 576)
    if kv == "fp8":
        query = query.to(fp8)
    indptr = torch.tensor([0, 20, 29], dtype=torch.int32)
    indices = torch.cat([torch.arange(20), torch.arange(9)]).to(torch.int32)
    with override(platform):
        _, raw = fake_aiter.mla.mla_decode_fwd(
            query.contiguous(), kv_cache.view(rows, 1, 1, 576), torch.empty(query.shape[0], num_heads, 512, dtype=torch.bfloat16),
            torch.arange(0, 3 * query_len, query_len, dtype=torch.int32), indptr, indices,
            torch.ones(2, dtype=torch.int32), query_len, sm_scale=0.1, num_kv_splits=1,
            q_scale=torch.ones(1) if kv == "fp8" else None, kv_scale=k_scale, return_lse=True)
        assert torch.isnan(raw).all(), "aiter leaves this LSE unwritten"
        impl = _decode_impl(num_heads, 16, kv_dtype)
        route = impl.route(query_len)
        out, lse = impl.forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens, k_scale=k_scale)
    assert lse is None or torch.isfinite(lse).all(), route.describe()
    assert torch.isfinite(out).all()
    call = fake_aiter.mla.CALLS[-1]
    assert call["lse_written"] or not call["return_lse"]


def test_split_kv_route_forces_two_splits_for_its_lse(fake_aiter):
    """gfx942 bf16 with 64 heads and 2 tokens has no persistent kernel: the split-KV route asks for the LSE with
    at least two splits, and a caller's num_kv_splits=1 is raised to 2."""
    q_nope, q_pe, kv_cache, block_table, seq_lens = _decode_case(64, 16, [33, 5], query_len=2)
    with override("MI300X"):
        impl = _decode_impl(64, 16)
        route = impl.route(2)
        out, lse = impl.forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens, num_kv_splits=1)
    assert (route.persistent, route.lse) == (True, False)  # aiter folds 64 heads onto its 16-head persistent kernel
    q_nope, q_pe, kv_cache, block_table, seq_lens = _decode_case(8, 16, [33, 5])
    with override("MI355X"):
        impl = _decode_impl(8, 16)
        route = impl.route(1)
        out, lse = impl.forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens, num_kv_splits=1)
    assert (route.persistent, route.lse) == (False, True)
    assert fake_aiter.mla.CALLS[-1]["num_kv_splits"] == 2 and fake_aiter.mla.CALLS[-1]["lse_written"]
    _check_against_reference(out, lse, q_nope, q_pe, kv_cache, block_table, seq_lens, 0.1, route)


# --------------------------------------------------------------------------- the persistent path, planned once a step


def test_plan_builds_the_metadata_once_for_every_layer(fake_aiter):
    import aiter.ops.attention as attention

    attention.CALLS.clear()
    workspace = WorkspaceManager("cpu")
    q_nope, q_pe, kv_cache, block_table, seq_lens = _decode_case(16, 16, [40, 0, 70])
    with override("MI355X"):
        impl = _decode_impl(16, 16)
        impl.reserve_workspace(workspace, max_num_seqs=8, max_model_len=4096)
        assert [c["function"] for c in attention.CALLS] == ["get_mla_metadata_info_v1"]
        assert attention.CALLS[0]["batch_size"] == 8, "sized once, for the largest batch"
        plan = impl.plan(seq_lens.clone(), block_table, 1)
        outputs = [impl.forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens, plan=plan,
                                    workspace_manager=workspace)[0].clone() for _layer in range(3)]
    assert [c["function"] for c in attention.CALLS] == ["get_mla_metadata_info_v1", "get_mla_metadata_v1"]
    assert attention.CALLS[1]["kv_granularity"] == 16 and attention.CALLS[1]["page_size"] == 1
    assert all(c["persistent"] for c in fake_aiter.mla.CALLS) and len(fake_aiter.mla.CALLS) == 3
    assert all(torch.equal(o, outputs[0]) for o in outputs)
    total = int(seq_lens.sum())
    assert plan.kv_indices.numel() == total, "the index list covers the step's valid tokens"
    assert plan.kv_indptr.tolist() == [0, 40, 40, 110]


def test_a_stale_plan_is_caught(fake_aiter):
    """Metadata of another step (other lengths) reaches aiter's kernels as garbage; the stand-in refuses it."""
    q_nope, q_pe, kv_cache, block_table, seq_lens = _decode_case(16, 16, [40, 3])
    with override("MI355X"):
        impl = _decode_impl(16, 16)
        plan = impl.plan(seq_lens, block_table, 1)
        other = impl.plan(seq_lens + 1, block_table, 1)  # the next step, same buffers
        assert other.work["work_meta_data"] is plan.work["work_meta_data"]
        with pytest.raises(AssertionError, match="another step"):
            fake_aiter.mla.mla_decode_fwd(
                torch.zeros(2, 16, 576, dtype=torch.bfloat16), kv_cache.view(-1, 1, 1, 576),
                torch.empty(2, 16, 512, dtype=torch.bfloat16), plan.qo_indptr,
                torch.tensor([0, 40, 43], dtype=torch.int32), plan.kv_indices, plan.kv_last_page_lens, 1,
                work_meta_data=plan.work["work_meta_data"], work_indptr=plan.work["work_indptr"],
                work_info_set=plan.work["work_info_set"], reduce_indptr=plan.work["reduce_indptr"],
                reduce_final_map=plan.work["reduce_final_map"], reduce_partial_map=plan.work["reduce_partial_map"])


def test_graph_plans_reuse_fixed_buffers(fake_aiter):
    """A graph captured after one plan replays after the next: the same tensors, rewritten; -1 past the tokens."""
    q_nope, q_pe, kv_cache, block_table, seq_lens = _decode_case(128, 16, [40, 3, 9])
    with override("MI300X"):
        impl = _decode_impl(128, 16)
        first = impl.plan(seq_lens, block_table, 1, cuda_graph=True)
        second = impl.plan(seq_lens // 2, block_table, 1, cuda_graph=True)
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens"):
        assert getattr(first, name).data_ptr() == getattr(second, name).data_ptr(), name
    assert first.work["work_info_set"].data_ptr() == second.work["work_info_set"].data_ptr()
    total = int((seq_lens // 2).sum())
    assert second.kv_indices.numel() == block_table.numel() * 16
    assert (second.kv_indices[total:] == -1).all()


def test_the_batch_gate_keeps_the_lse(fake_aiter):
    """gfx950, bf16, 16 heads, 1 token: aiter sends a batch of 32 or more to its split-KV kernel (its split count
    left to aiter), which writes the LSE there too."""
    seq_lens = [30 + i for i in range(40)]
    q_nope, q_pe, kv_cache, block_table, seq_lens_t = _decode_case(16, 16, seq_lens)
    with override("MI355X"):
        impl = _decode_impl(16, 16)
        route = impl.route(1)
        out, lse = impl.forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens_t)
    assert route.persistent and route.lse
    assert fake_aiter.mla.CALLS[-1]["gated"] and fake_aiter.mla.CALLS[-1]["lse_written"]
    _check_against_reference(out, lse, q_nope, q_pe, kv_cache, block_table, seq_lens_t, 0.1, route)


def test_decode_rejects_a_configuration_without_kernel(fake_aiter):
    q_nope, q_pe, kv_cache, block_table, seq_lens = _decode_case(32, 16, [33, 5], torch.float8_e4m3fnuz,
                                                                   torch.tensor([0.1]), query_len=5)
    with override("MI300X"), pytest.raises(ValueError) as error:
        _decode_impl(32, 16, torch.float8_e4m3fnuz).forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens,
                                                                  k_scale=torch.tensor([0.1]))
    assert "no mla_decode_fwd kernel on gfx942 for 32 heads, 5 query tokens" in str(error.value)
    assert "accepted here: num_heads 128 (persistent)" in str(error.value)


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_matches_reference(fake_aiter, causal):
    generator = torch.Generator().manual_seed(int(causal))
    lens_q, lens_k = [5, 0, 9], ([5, 0, 9] if causal else [7, 4, 12])
    cu_q = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    cu_k = torch.cumsum(torch.tensor([0] + lens_k), 0).to(torch.int32)
    heads = 4
    q = torch.randn(14, heads, 192, generator=generator).to(torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), heads, 192, generator=generator).to(torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), heads, 128, generator=generator).to(torch.bfloat16)
    impl = rocm_aiter.AiterMLAPrefillImpl(heads, 0.08, 512, 128, 64, 128)
    out, lse = impl.forward_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal, True)
    ref, ref_lse = varlen_attention_reference(q.double(), k.double(), v.double(), cu_q, cu_k, 0.08, causal)
    assert out.shape == (14, heads, 128) and lse.shape == (heads, 14) and lse.dtype == torch.float32
    assert relative_error(out, ref) < 1e-2
    assert relative_error(lse, ref_lse) < 1e-3
    only_out = impl.forward_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal, False)
    assert torch.equal(only_out, out)
    assert [c["softmax_scale"] for c in fake_aiter.ops.mha.CALLS] == [0.08, 0.08]
    # the sink goes to aiter as sink_ptr and scales each row by sigmoid(lse - sink)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    sunk, sunk_lse = impl.forward_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal, True, sink=sink)
    assert fake_aiter.ops.mha.CALLS[-1]["sink"]
    factor = torch.sigmoid(ref_lse - sink.double().unsqueeze(1)).transpose(0, 1).unsqueeze(2)
    seen = torch.isfinite(ref_lse).transpose(0, 1).unsqueeze(2)
    assert relative_error(sunk, torch.where(seen, ref * factor, 0)) < 1e-2
    assert torch.equal(sunk_lse, lse)


def test_prefill_empty_rows_give_zero_and_minus_inf(fake_aiter):
    q = torch.randn(3, 2, 192).to(torch.bfloat16)
    kv = torch.zeros(0, 2, 192, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 3], dtype=torch.int32)
    cu_k = torch.tensor([0, 0], dtype=torch.int32)
    impl = rocm_aiter.AiterMLAPrefillImpl(2, 0.1, 512, 128, 64, 128)
    out, lse = impl.forward_varlen(q, kv, kv[..., :128], cu_q, cu_k, 3, 0, False, True)
    assert not out.any()
    assert torch.equal(lse, torch.full((2, 3), float("-inf")))


# --------------------------------------------------------------------------- selection


def _registry() -> Registry:
    return Registry(
        backends={
            "prefill": {"ROCM_AITER": rocm_aiter.AiterMLAPrefillBackend,
                        "REFERENCE": "mla_multi.backends.reference:ReferencePrefillBackend"},
            "decode": {"ROCM_AITER": rocm_aiter.AiterMLADecodeBackend,
                       "REFERENCE": "mla_multi.backends.reference:ReferenceDecodeBackend"},
        },
        priorities={
            "prefill": {("rocm", None): ("ROCM_AITER", "REFERENCE"), ("cuda", None): ("REFERENCE",), ("cpu", None): ("REFERENCE",)},
            "decode": {("rocm", None): ("ROCM_AITER", "REFERENCE"), ("cuda", None): ("REFERENCE",), ("cpu", None): ("REFERENCE",)},
        },
    )


def _decode_config(platform: str, num_heads: int, kv_cache_dtype, dtype=torch.bfloat16, block_size=64,
                   max_query_len=1, needs_lse=False):
    resolved = SPECS[platform].fp8_dtype if kv_cache_dtype == "fp8" else kv_cache_dtype
    return DecodeSelectorConfig(MLADims.deepseek_v3(num_heads), dtype, resolved, block_size, max_query_len,
                                needs_lse=needs_lse)


FAKE_LABEL = "aiter 0.1.20.post1+fake"

# The route of every DeepSeek-V3 decode at 16, 32, 64 and 128 heads (TP 8, 4, 2, 1) and 1-4 query tokens on
# aiter v0.1.20.post1: P persistent, S split-KV; +LSE where the kernel writes the LSE. Nothing falls back.
SELECTION_TABLE = {
    ("MI300X", "bf16"): {16: "P P P P", 32: "P P P P", 64: "P P P P", 128: "P P P P"},
    ("MI300X", "fp8"): {16: "P P P P", 32: "P P P P", 64: "P+LSE P P P", 128: "P P P P"},
    ("MI355X", "bf16"): {16: "P+LSE P+LSE P+LSE P+LSE", 32: "P+LSE P+LSE P+LSE P+LSE",
                         64: "P+LSE P+LSE P+LSE P+LSE", 128: "P+LSE P+LSE P+LSE P+LSE"},
    ("MI355X", "fp8"): {16: "P+LSE P P+LSE P+LSE", 32: "P+LSE P+LSE P+LSE P+LSE",
                        64: "P+LSE P+LSE P+LSE P+LSE", 128: "P+LSE P+LSE P+LSE P+LSE"},
}


def _route_cell(route) -> str:
    if route is None:
        return "fallback"
    return ("P" if route.persistent else "S") + ("+LSE" if route.lse else "")


@pytest.mark.parametrize("platform, kv", list(SELECTION_TABLE), ids=lambda v: str(v))
def test_selection_table(fake_aiter, platform, kv):
    registry = _registry()
    kv_dtype = torch.bfloat16 if kv == "bf16" else SPECS[platform].fp8_dtype
    with override(platform):
        found = {heads: " ".join(_route_cell(rocm_aiter.aiter_decode_route(ARCH[platform], heads, q, kv_dtype))
                                 for q in (1, 2, 3, 4)) for heads in (16, 32, 64, 128)}
        assert found == SELECTION_TABLE[(platform, kv)]
        for heads, cells in found.items():
            for query_len, cell in enumerate(cells.split(), start=1):
                config = _decode_config(platform, heads, kv_dtype, max_query_len=query_len)
                assert registry.select("decode", config, SPECS[platform]).name == "ROCM_AITER"
                needs = dataclasses.replace(config, needs_lse=True)
                chosen = registry.select("decode", needs, SPECS[platform]).name
                # the LSE for a chunk merge or a sink: only from a kernel that writes it, for every token count
                every = all(c.endswith("+LSE") for c in cells.split()[:query_len])
                assert chosen == ("ROCM_AITER" if every else "REFERENCE"), (heads, query_len, chosen)
        info = rocm_aiter.AiterMLADecodeBackend.info()
    assert info["aiter_source"].startswith("v0.1.20.post1 (de07f3885ee5")
    assert set(info["routes"]) == {"bfloat16", dtype_name(SPECS[platform].fp8_dtype)}
    assert info["routes"][dtype_name(kv_dtype)][128][1].startswith("persistent")
    table = rocm_aiter.route_table(SPECS[platform], (16, 32, 64, 128))["routes"][dtype_name(kv_dtype)]
    assert {h: " ".join(("P" if t.startswith("persistent") else "S") + ("+LSE" if ", LSE" in t else "") for t in row.values())
            for h, row in table.items()} == SELECTION_TABLE[(platform, kv)]


def test_lse_reason_names_the_tokens_and_cache(fake_aiter):
    registry = _registry()
    config = _decode_config("MI300X", 128, torch.bfloat16, max_query_len=2, needs_lse=True)
    assert registry.reasons("decode", "ROCM_AITER", SPECS["MI300X"], config) == [
        f"the LSE with num_heads 128, 1, 2 query tokens and a bfloat16 cache is not written by {FAKE_LABEL} on "
        "MI300X (gfx942)'s mla_decode_fwd (no kernel of its tables that runs it writes the LSE); accepted with the "
        "LSE: the configurations whose route says LSE (mla-multi info), or another backend"
    ]


@pytest.mark.parametrize("platform", ["MI300X", "MI355X"])
@pytest.mark.parametrize("kv_cache_dtype", [torch.bfloat16, "fp8"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_heads", [1, 8, 16, 20, 32, 40, 48, 64, 96, 128])
def test_every_head_count_runs(fake_aiter, platform, kv_cache_dtype, num_heads):
    registry = _registry()
    config = _decode_config(platform, num_heads, kv_cache_dtype)
    assert registry.reasons("decode", "ROCM_AITER", SPECS[platform], config) == []
    route = rocm_aiter.aiter_decode_route(ARCH[platform], num_heads, 1, config.kv_cache_dtype)
    assert route.padded == (num_heads not in (8, 16, 32, 48, 64, 96, 128))


def test_decode_reasons_name_version_and_platform(fake_aiter):
    registry = _registry()
    mi300 = SPECS["MI300X"]
    wrong_fp8 = DecodeSelectorConfig(MLADims.deepseek_v3(16), torch.bfloat16, torch.float8_e4m3fn, 64)
    assert registry.reasons("decode", "ROCM_AITER", mi300, wrong_fp8) == [
        f"kv_cache_dtype float8_e4m3fn is not supported by {FAKE_LABEL} on MI300X (gfx942); its fp8 type is float8_e4m3fnuz"
    ]
    fp16 = DecodeSelectorConfig(MLADims.deepseek_v3(16), torch.float16, torch.float16, 64)
    assert registry.reasons("decode", "ROCM_AITER", mi300, fp16) == [
        f"dtype float16 is not supported by {FAKE_LABEL} on MI300X (gfx942); supported: bfloat16",
        f"kv_cache_dtype float16 is not supported by {FAKE_LABEL} on MI300X (gfx942); supported: bfloat16, float8_e4m3fnuz",
    ]
    mtp = _decode_config("MI300X", 32, "fp8", max_query_len=5)
    assert registry.reasons("decode", "ROCM_AITER", mi300, mtp) == [
        f"num_heads 32 with 5 query tokens and a float8_e4m3fnuz cache is not supported by {FAKE_LABEL} on MI300X "
        "(gfx942): aiter's kernel tables (v0.1.20.post1) have no mla_decode_fwd kernel for it; accepted with 5: "
        "num_heads 128 (persistent); others padded to a multiple of 16 where that runs"
    ]
    assert registry.reasons("decode", "ROCM_AITER", SPECS["MI355X"], _decode_config("MI355X", 32, "fp8", max_query_len=5)) == []
    long = _decode_config("MI355X", 16, torch.bfloat16, max_query_len=9)
    assert registry.reasons("decode", "ROCM_AITER", SPECS["MI355X"], long) == [
        f"max_query_len 9 is not supported by {FAKE_LABEL} on MI355X (gfx950)'s mla_decode_fwd; accepted: 1-8 where "
        "its kernel tables have a kernel"
    ]
    for other in ("MI250X", "RX7900XTX"):
        reasons = registry.reasons("decode", "ROCM_AITER", SPECS[other], _decode_config(other, 16, torch.bfloat16))
        assert reasons[0] == (f"{FAKE_LABEL} has no MLA decode kernels for {other} ({SPECS[other].arch}); "
                              "supported: gfx942, gfx950")
    h100 = registry.reasons("decode", "ROCM_AITER", SPECS["H100"], _decode_config("H100", 16, torch.bfloat16))
    assert h100 == ["platform H100 (cuda sm_90) is not supported; aiter runs on ROCm only"]
    with pytest.raises(NoBackendError, match="num_heads 32 with 5 query tokens"):
        registry.select("decode", mtp, mi300, backend="ROCM_AITER")


@pytest.mark.parametrize("platform", ["MI300X", "MI355X"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prefill_selection_with_aiter(fake_aiter, platform, dtype):
    registry = _registry()
    chosen = registry.select("prefill", PrefillSelectorConfig(MLADims.deepseek_v3(16), dtype), SPECS[platform])
    assert chosen.name == "ROCM_AITER"
    fp32 = registry.reasons("prefill", "ROCM_AITER", SPECS[platform], PrefillSelectorConfig(MLADims.deepseek_v3(16), torch.float32))
    fp8 = ", float8_e4m3fn (FP8 k / v: aiter's FP8 MLA prefill)" if platform == "MI355X" else ""
    assert fp32 == [f"dtype float32 is not supported by {FAKE_LABEL} on {platform} ({SPECS[platform].arch}); "
                    f"supported: float16, bfloat16{fp8}"]


def test_fp8_prefill_selection_follows_aiters_facts(fake_aiter):
    """FP8 prefill (FP8 k / v) on gfx950 with DeepSeek's qk 192 / v 128, any head count; elsewhere reasons that
    name the value: gfx942 (aiter refuses it), another FP8 type, other head dims."""
    registry = _registry()
    dims = MLADims.deepseek_v3(16)
    mi355, mi300 = SPECS["MI355X"], SPECS["MI300X"]
    for heads in (1, 16, 20, 128):
        config = PrefillSelectorConfig(MLADims.deepseek_v3(heads), torch.float8_e4m3fn)
        assert registry.reasons("prefill", "ROCM_AITER", mi355, config) == []
        assert registry.select("prefill", config, mi355).name == "ROCM_AITER"
    kernels = "mla_pfl_qh192_vh128_m32x8_n128x1_causal1; mla_pfl_qh192_vh128_m32x8_n128x1_causal0"
    text = (f"aiter's FP8 MLA prefill (mla_prefill_ps_asm_fwd over get_ps_metadata_v1 work, partials merged by "
            f"mla_reduce_v1; kernels {kernels}; gfx950 only)")
    assert registry.reasons("prefill", "ROCM_AITER", mi300, PrefillSelectorConfig(dims, torch.float8_e4m3fnuz)) == [
        f"dtype float8_e4m3fnuz is not supported by {FAKE_LABEL} on MI300X (gfx942): {text} does not run on gfx942: "
        "aiter refuses it ('fp8 mla persistent prefill is not supported on gfx942'); supported there: float16, "
        "bfloat16 (flash_attn_varlen_func)"
    ]
    assert registry.reasons("prefill", "ROCM_AITER", mi355, PrefillSelectorConfig(dims, torch.float8_e4m3fnuz)) == [
        f"dtype float8_e4m3fnuz is not supported by {FAKE_LABEL} on MI355X (gfx950): {text} takes float8_e4m3fn "
        "(the platform's FP8); supported: float16, bfloat16, float8_e4m3fn"
    ]
    wide = MLADims(16, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=128)
    assert registry.reasons("prefill", "ROCM_AITER", mi355, PrefillSelectorConfig(wide, torch.float8_e4m3fn)) == [
        f"qk_head_dim 256 / v_head_dim 128 are not supported by {FAKE_LABEL} on MI355X (gfx950) in float8_e4m3fn: "
        "the kernel table's FP8 prefill kernels are qk 192 / v 128 (qh192_vh128)"
    ]
    with pytest.raises(NoBackendError, match="does not run on gfx942"):
        registry.select("prefill", PrefillSelectorConfig(dims, torch.float8_e4m3fnuz), mi300, backend="ROCM_AITER")
    # the dequantising last resort runs it elsewhere
    assert registry.select("prefill", PrefillSelectorConfig(dims, torch.float8_e4m3fnuz), mi300).name == "REFERENCE"


def test_fp8_prefill_needs_aiters_fp8_prefill_functions(fake_aiter, monkeypatch):
    monkeypatch.delattr(fake_aiter, "get_ps_metadata_v1")
    rocm_aiter.clear_probe_cache()
    config = PrefillSelectorConfig(MLADims.deepseek_v3(16), torch.float8_e4m3fn)
    assert _registry().reasons("prefill", "ROCM_AITER", SPECS["MI355X"], config) == [
        f"{FAKE_LABEL} has no get_ps_metadata_v1 (aiter's FP8 MLA prefill, gfx950; this adapter follows v0.1.20.post1)"
    ]


def _fp8_prefill_case(num_heads: int, lengths: list[int], seed: int):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, num_heads, 192, generator=generator).to(torch.bfloat16)
    k = (torch.randn(total, num_heads, 192, generator=generator) * 0.7).to(torch.bfloat16)
    v = torch.randn(total, num_heads, 128, generator=generator).to(torch.bfloat16)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    return q, k, v, cu


def _fp8_impl(num_heads: int, scale: float):
    return rocm_aiter.AiterMLAPrefillImpl(num_heads, scale, 512, 128, 64, 128)


@pytest.mark.parametrize("num_heads, lengths, causal", [
    pytest.param(16, [300, 17, 0, 513], True, id="16-heads-causal"),
    pytest.param(16, [300, 17, 0, 513], False, id="16-heads-not-causal"),
    pytest.param(128, [260, 5], True, id="128-heads"),
    pytest.param(3, [700], True, id="3-heads-one-long"),
])
def test_fp8_prefill_matches_float64_within_fp8_tolerance(fake_aiter, num_heads, lengths, causal):
    """On an impersonated MI355X: FP8 k / v with their scales, the query quantised by the adapter per tensor
    (amax / 448); aiter's planner splits the long tiles over workgroups and mla_reduce_v1 merges them; every row
    matches float64 attention over the unquantised inputs within FP8 tolerance."""
    import aiter.ops.attention as attention

    q, k, v, cu = _fp8_prefill_case(num_heads, lengths, num_heads + len(lengths))
    k8, k_scale = rocm_aiter.quantize_per_tensor(k, torch.float8_e4m3fn)
    v8, v_scale = rocm_aiter.quantize_per_tensor(v, torch.float8_e4m3fn)
    scale = 192 ** -0.5
    with override("MI355X"):
        out = _fp8_impl(num_heads, scale).forward_varlen(q, k8, v8, cu, cu, max(lengths), max(lengths), causal,
                                                         False, k_scale=k_scale, v_scale=float(v_scale))
    ref, _ = varlen_attention_reference(q.double(), k.double(), v.double(), cu, cu, scale, causal)
    assert out.dtype == torch.bfloat16 and out.shape == (sum(lengths), num_heads, 128)
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if lengths[b]:
            assert relative_error(out[rows], ref[rows]) < 6e-2, (b, relative_error(out[rows], ref[rows]))
    calls = {c["function"]: c for c in attention.CALLS}
    plan, kernel = calls["get_ps_metadata_v1"], calls["mla_prefill_ps_asm_fwd"]
    assert (plan["gqa_ratio"], plan["num_heads_k"], plan["qlen_granularity"], plan["kvlen_granularity"],
            plan["block_size"], plan["is_causal"]) == (1, num_heads, 256, 128, 1, causal)
    assert plan["partials"] > 0 and calls["mla_reduce_v1"]["groups"] > 0  # split tiles went through the reduce
    assert kernel["kernel"] == f"mla_pfl_qh192_vh128_m32x8_n128x1_causal{int(causal)}"
    assert kernel["softmax_scale"] == scale and kernel["q_dtype"] == torch.float8_e4m3fn
    q_scale = q.float().abs().max().item() / 448
    assert kernel["scales"] == pytest.approx([q_scale, k_scale.item(), v_scale.item()], rel=1e-6)
    assert calls["mla_reduce_v1"]["final_lse"] is False and calls["mla_reduce_v1"]["max_seqlen_q"] == 256


def test_fp8_prefill_through_the_public_op(fake_aiter):
    """`mm.ops.mla_prefill` with FP8 k / v and their scales: on an impersonated MI355X the registry sends it to
    ROCM_AITER's FP8 prefill (aiter's kernel called), on MI300X to REFERENCE (dequantised); both within FP8
    tolerance of float64 attention over the unquantised inputs."""
    import aiter.ops.attention as attention

    import mla_multi as mm

    q, k, v, cu = _fp8_prefill_case(16, [70, 33], 11)
    scale = 192 ** -0.5
    ref, _ = varlen_attention_reference(q.double(), k.double(), v.double(), cu, cu, scale, True)
    for spec, fp8, served in (("MI355X", torch.float8_e4m3fn, True), ("MI300X", torch.float8_e4m3fnuz, False)):
        k8, k_scale = rocm_aiter.quantize_per_tensor(k, fp8)
        v8, v_scale = rocm_aiter.quantize_per_tensor(v, fp8)
        attention.CALLS.clear()
        with override(spec):
            out = mm.ops.mla_prefill(q, k8, v8, cu, cu, 70, 70, scale, k_scale=k_scale, v_scale=float(v_scale))
        assert out.dtype == torch.bfloat16 and relative_error(out, ref) < 6e-2, (spec, relative_error(out, ref))
        called = any(c["function"] == "mla_prefill_ps_asm_fwd" for c in attention.CALLS)
        assert called == served, spec


def test_fp8_prefill_takes_an_fp8_query_with_its_scale(fake_aiter):
    q, k, v, cu = _fp8_prefill_case(8, [40, 90], 5)
    q8, q_scale = rocm_aiter.quantize_per_tensor(q, torch.float8_e4m3fn)
    k8, k_scale = rocm_aiter.quantize_per_tensor(k, torch.float8_e4m3fn)
    v8, v_scale = rocm_aiter.quantize_per_tensor(v, torch.float8_e4m3fn)
    with override("MI355X"):
        impl = _fp8_impl(8, 0.07)
        out = impl.forward_varlen(q8, k8, v8, cu, cu, 90, 90, True, False, q_scale=q_scale, k_scale=k_scale,
                                  v_scale=v_scale)
        half = impl.forward_varlen(q.half(), k8, v8, cu, cu, 90, 90, True, False, k_scale=k_scale, v_scale=v_scale)
    ref, _ = varlen_attention_reference(q.double(), k.double(), v.double(), cu, cu, 0.07, True)
    assert relative_error(out, ref) < 6e-2
    assert half.dtype == torch.float16 and relative_error(half, ref) < 6e-2


def test_fp8_prefill_declines_what_aiter_cannot_give(fake_aiter):
    """No LSE (so no context chunk to merge), no cached context, no sink; MI300X: aiter refuses it."""
    q, k, v, cu = _fp8_prefill_case(4, [30, 20], 9)
    k8, k_scale = rocm_aiter.quantize_per_tensor(k, torch.float8_e4m3fn)
    v8, v_scale = rocm_aiter.quantize_per_tensor(v, torch.float8_e4m3fn)
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    with override("MI355X"):
        impl = _fp8_impl(4, 0.1)
        with pytest.raises(ValueError, match="return_softmax_lse=True with ROCM_AITER's FP8 prefill on MI355X "
                                             r"\(gfx950\): aiter's FP8 prefill returns no LSE: mla_reduce_v1 writes "
                                             "final_lse only for the query tiles it merges"):
            impl.forward_varlen(q, k8, v8, cu, cu, 30, 30, True, True, **scales)
        context = torch.tensor([0, 40, 50], dtype=torch.int32)
        k_long, v_long = torch.cat([k8, k8[:0]]), torch.cat([v8, v8[:0]])
        with pytest.raises(ValueError, match="cu_seqlens_k differs from cu_seqlens_q"):
            impl.forward_varlen(q, k_long, v_long, cu, context, 30, 40, True, False, **scales)
        with pytest.raises(ValueError, match="a sink with ROCM_AITER's FP8 prefill"):
            impl.forward_varlen(q, k8, v8, cu, cu, 30, 30, True, False, torch.zeros(4), **scales)
        with pytest.raises(ValueError, match="k_scale=None"):
            impl.forward_varlen(q, k8, v8, cu, cu, 30, 30, True, False)
        with pytest.raises(ValueError, match="q_scale with a bfloat16 query"):
            impl.forward_varlen(q, k8, v8, cu, cu, 30, 30, True, False, q_scale=1.0, **scales)
        with pytest.raises(ValueError, match="k_scale with bfloat16 keys"):
            impl.forward_varlen(q, k, v, cu, cu, 30, 30, True, False, k_scale=1.0)
        with pytest.raises(ValueError, match="q head dim 128 / v head dim 128"):
            impl.forward_varlen(q[..., :128], k8[..., :128], v8, cu, cu, 30, 30, True, False, **scales)
    with override("MI300X"):
        with pytest.raises(ValueError, match="does not run on gfx942"):
            _fp8_impl(4, 0.1).forward_varlen(q, k8, v8, cu, cu, 30, 30, True, False, **scales)


def test_fake_reduce_leaves_the_lse_of_unsplit_tiles_unwritten(fake_aiter):
    """Why the adapter returns no FP8 LSE: the stand-in, as aiter, writes final_lse only where it merges."""
    import aiter.ops.attention as attention

    with override("MI355X"):
        q, k, v, cu = _fp8_prefill_case(2, [600, 40], 3)
        lengths = (cu[1:] - cu[:-1]).to(torch.int32)
        buffers = rocm_aiter._fp8_prefill_metadata(2, 2, 600, torch.device("cpu"))
        attention.get_ps_metadata_v1(cu, cu, lengths, 1, 2, buffers["work_metadata_ptrs"], buffers["work_indptr"],
                                     buffers["work_info"], buffers["reduce_indptr"], buffers["reduce_final_map"],
                                     buffers["reduce_partial_map"], 1, 256, 128, 1, True)
        q8, qs = rocm_aiter.quantize_per_tensor(q, torch.float8_e4m3fn)
        k8, ks = rocm_aiter.quantize_per_tensor(k, torch.float8_e4m3fn)
        v8, vs = rocm_aiter.quantize_per_tensor(v, torch.float8_e4m3fn)
        rows = buffers["reduce_partial_map"].shape[0] * 256
        partial, partial_lse = torch.zeros(rows, 2, 128), torch.zeros(rows, 2)
        out = torch.full((640, 2, 128), float("nan"), dtype=torch.bfloat16)
        final_lse = torch.full((640, 2), float("nan"))
        attention.mla_prefill_ps_asm_fwd(q8, k8, v8, cu, cu, torch.arange(640, dtype=torch.int32),
                                         buffers["work_indptr"], buffers["work_info"], 600, 0.1, True, partial,
                                         partial_lse, out, qs, ks, vs)
        attention.mla_reduce_v1(partial, partial_lse, buffers["reduce_indptr"], buffers["reduce_final_map"],
                                buffers["reduce_partial_map"], 256, 0, out, final_lse)
    assert torch.isfinite(out.float()).all()
    merged = torch.zeros(640, dtype=torch.bool)
    count = int((buffers["reduce_indptr"][1:] > buffers["reduce_indptr"][:-1]).sum())
    for start, end in buffers["reduce_final_map"][:count].tolist():
        merged[start:end] = True
    assert merged.any() and not merged.all()
    assert torch.isfinite(final_lse[merged]).all() and torch.isnan(final_lse[~merged]).all()


def test_info_as_mi355x_shows_the_fp8_prefill(capsys):
    from mla_multi import cli

    assert cli.main(["info", "--as", "MI355X"]) == 0
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if line.strip().startswith("ROCM_AITER") and "FP8 prefill" in line)
    assert "FP8 prefill: FP8 k / v (float8_e4m3fn, per-tensor k_scale / v_scale; the query quantised here per " \
           "tensor, amax / 448)" in line and "no LSE" in line
    assert cli.main(["info", "--as", "MI300X"]) == 0
    assert "FP8 prefill: declined on gfx942: aiter refuses it" in capsys.readouterr().out


def test_an_aiter_without_metadata_functions_is_unavailable(fake_aiter, monkeypatch):
    monkeypatch.delattr(fake_aiter, "get_mla_metadata_v1")
    rocm_aiter.clear_probe_cache()
    registry = _registry()
    config = _decode_config("MI355X", 128, torch.bfloat16)
    assert registry.select("decode", config, SPECS["MI355X"]).name == "REFERENCE"
    assert registry.reasons("decode", "ROCM_AITER", SPECS["MI355X"], config) == [
        f"{FAKE_LABEL} has no get_mla_metadata_info_v1 / get_mla_metadata_v1 (aiter's persistent MLA decode, in "
        "aiter since 2025-12; this adapter follows v0.1.20.post1)"
    ]


def test_fp8_needs_an_aiter_with_scales(fake_aiter, monkeypatch):
    def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None,
                       work_meta_data=None, work_indptr=None, work_info_set=None, reduce_indptr=None,
                       reduce_final_map=None, reduce_partial_map=None, return_lse=False, causal=True):
        raise AssertionError("not called in this test")

    monkeypatch.setattr(fake_aiter.mla, "mla_decode_fwd", mla_decode_fwd)
    rocm_aiter.clear_probe_cache()
    registry = _registry()
    config = _decode_config("MI355X", 128, "fp8")
    assert registry.select("decode", config, SPECS["MI355X"]).name == "REFERENCE"
    assert registry.reasons("decode", "ROCM_AITER", SPECS["MI355X"], config) == [
        f"kv_cache_dtype float8_e4m3fn is not supported by {FAKE_LABEL} on MI355X (gfx950): "
        "its mla_decode_fwd takes no q_scale / kv_scale (no fp8 kernels)"
    ]
    assert registry.select("decode", _decode_config("MI355X", 128, torch.bfloat16), SPECS["MI355X"]).name == "ROCM_AITER"


def test_kernel_inventory_limits_the_architectures(fake_aiter, monkeypatch):
    monkeypatch.setattr(rocm_aiter, "_kernel_archs", lambda module: ("gfx942",))
    rocm_aiter.clear_probe_cache()
    registry = _registry()
    config = _decode_config("MI355X", 16, torch.bfloat16)
    assert registry.reasons("decode", "ROCM_AITER", SPECS["MI355X"], config) == [
        f"{FAKE_LABEL} has no MLA decode kernels for MI355X (gfx950); shipped with kernels: gfx942"
    ]
    assert registry.select("decode", _decode_config("MI300X", 16, torch.bfloat16), SPECS["MI300X"]).name == "ROCM_AITER"


@pytest.mark.parametrize("num_heads", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("platform", ["MI300X", "MI355X"])
def test_selection_without_aiter_falls_back(missing_aiter, platform, num_heads):
    registry = _registry()
    for kv_cache_dtype in (torch.bfloat16, "fp8"):
        config = _decode_config(platform, num_heads, kv_cache_dtype)
        assert registry.select("decode", config, SPECS[platform]).name == "REFERENCE"
        assert registry.reasons("decode", "ROCM_AITER", SPECS[platform], config) == [
            "aiter is not installed (pip package amd-aiter)"
        ]
    prefill = PrefillSelectorConfig(MLADims.deepseek_v3(num_heads), torch.bfloat16)
    assert registry.select("prefill", prefill, SPECS[platform]).name == "REFERENCE"


def test_an_aiter_that_raises_on_import_is_a_reason(broken_aiter):
    registry = _registry()
    config = _decode_config("MI300X", 16, torch.bfloat16)
    reasons = registry.reasons("decode", "ROCM_AITER", SPECS["MI300X"], config)
    assert len(reasons) == 1
    assert reasons[0].startswith("import aiter ") and reasons[0].endswith("failed: RuntimeError: ROCm version file not found")
    assert registry.select("decode", config, SPECS["MI300X"]).name == "REFERENCE"
    assert not rocm_aiter.AiterMLAPrefillBackend.is_available()
    with pytest.raises(NoBackendError, match="ROCm version file not found"):
        registry.select("prefill", PrefillSelectorConfig(MLADims.deepseek_v3(16), torch.bfloat16), SPECS["MI300X"],
                        backend="ROCM_AITER")


def test_probe_is_cached(fake_aiter, monkeypatch):
    first = rocm_aiter.probe_aiter()
    calls = []
    monkeypatch.setattr(rocm_aiter.importlib, "import_module", lambda name: calls.append(name))
    assert rocm_aiter.probe_aiter() is first and calls == []
    assert rocm_aiter.AiterMLADecodeBackend.info()["aiter_version"] == "0.1.20.post1+fake"


def test_info_as_mi300x_and_mi355x_shows_the_routes(capsys):
    """`mla-multi info --as MI300X / MI355X` prints the routes per cache dtype, head count and query tokens from
    aiter's kernel tables, aiter installed or not."""
    from mla_multi import cli

    for spec, fp8 in (("MI300X", "float8_e4m3fnuz"), ("MI355X", "float8_e4m3fn")):
        assert cli.main(["info", "--as", spec]) == 0
        printed = capsys.readouterr().out
        assert "ROCM_AITER decode routes (aiter v0.1.20.post1 (de07f3885ee5) kernel tables" in printed
        lines = [line for line in printed.splitlines() if " heads  1: " in line]
        assert len(lines) == 10 and any(line.split()[0] == fp8 for line in lines)
    last_128_fp8 = [line for line in lines if line.split()[:2] == [fp8, "128"]]
    assert last_128_fp8 == ["  float8_e4m3fn    128 heads  1: persistent, LSE | 2: persistent, LSE | 3: persistent, LSE | "
                            "4: persistent, LSE"]
    assert cli.collect_info("H100")["rocm_aiter_decode"] is None


@pytest.mark.parametrize("platform, num_heads", [("MI300X", 16), ("MI355X", 128), ("MI355X", 20)])
def test_layer_decodes_through_the_plan(fake_aiter, platform, num_heads):
    """MLAAttention with ROCM_AITER decode on an impersonated GPU: `plan` builds the indexing and aiter's
    metadata once a step, every layer only launches; the steps match naive float64 MLA."""
    import aiter.ops.attention as attention

    import mla_multi as mm
    from mla_multi.testing import PagedScenario

    dims = MLADims.deepseek_v3(num_heads=num_heads)
    generator = torch.Generator().manual_seed(num_heads)
    weight = (torch.randn(num_heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank,
                          generator=generator) / dims.kv_lora_rank**0.5).to(torch.bfloat16)
    scale = dims.qk_head_dim**-0.5
    with override(platform):
        layers = [mm.MLAAttention(dims, scale, weight, block_size=16, max_model_len=512, max_num_seqs=8,
                                  decode_backend="ROCM_AITER", prefill_backend="REFERENCE",
                                  workspace=WorkspaceManager("cpu")) for _ in range(2)]
        assert layers[0].backends()["decode"] == "ROCM_AITER"
        scenario = PagedScenario(dims, 16, 64, torch.device("cpu"), torch.bfloat16, seed=1)
        cache = torch.zeros(64, 16, dims.kv_cache_width, dtype=torch.bfloat16)
        for requests in ([(0, 40), (1, 7)], [(0, 1), (1, 1)], [(1, 1), (0, 1), (2, 1)]):
            metadata, q, kv_c, k_pe = scenario.step(requests)
            attention.CALLS.clear()
            fake_aiter.mla.CALLS.clear()
            layers[0].plan(metadata)
            outs = [layer.forward(q, kv_c, k_pe, cache, metadata) for layer in layers]
            reference = scenario.reference(requests, q, scale, weight)
            assert all(relative_error(out, reference) < 2e-2 for out in outs)
            decodes = sum(1 for _, n in requests if n == 1) == len(requests)
            metadata_calls = [c for c in attention.CALLS if c["function"] == "get_mla_metadata_v1"]
            route = layers[0].decode_impl.route(1)
            assert len(metadata_calls) == (1 if decodes and route.persistent else 0), "once a step, for both layers"
            assert len(fake_aiter.mla.CALLS) == (2 if decodes else 0)


@pytest.mark.parametrize("platform, expected", [("MI300X", "TRITON"), ("MI355X", "ROCM_AITER")])
def test_callers_that_need_the_lse_get_a_backend_that_writes_it(fake_aiter, platform, expected):
    """mm.ops.mla_decode(return_lse=True) and a layer under decode context parallelism select with
    needs_lse: on MI300X bf16 aiter writes no decode LSE, so the registry takes the next backend."""
    from mla_multi import registry as registry_module

    registry_module.default_registry.clear_cache()
    try:
        with override(platform):
            plain = registry_module.select_decode_backend(MLADims.deepseek_v3(128), torch.bfloat16, torch.bfloat16, 64)
            needs = registry_module.select_decode_backend(MLADims.deepseek_v3(128), torch.bfloat16, torch.bfloat16, 64,
                                                          needs_lse=True)
    finally:
        registry_module.default_registry.clear_cache()
    assert (plain.name, needs.name) == ("ROCM_AITER", expected)


def test_folded_routes_with_several_tokens_never_write_into_the_workspace(fake_aiter, monkeypatch):
    """aiter hands a folded multi-token output back with `o.set_`, which would detach a workspace view."""
    import functools

    base = fake_aiter.mla.mla_decode_fwd
    outputs = []

    @functools.wraps(base)
    def recording(q, kv_buffer, o, *args, **kwargs):
        outputs.append(o.untyped_storage().data_ptr())
        return base(q, kv_buffer, o, *args, **kwargs)

    monkeypatch.setattr(fake_aiter.mla, "mla_decode_fwd", recording)
    workspace = WorkspaceManager("cpu")
    q_nope, q_pe, kv_cache, block_table, seq_lens = _decode_case(48, 16, [33, 5], query_len=2)
    with override("MI300X"):
        impl = _decode_impl(48, 16)
        impl.reserve_workspace(workspace, max_num_seqs=4, max_model_len=256, max_query_len=2)
        route = impl.route(2)
        impl.forward_mqa(q_nope, q_pe, kv_cache, block_table, seq_lens, workspace_manager=workspace)
        impl.forward_mqa(q_nope[:, 0], q_pe[:, 0], kv_cache, block_table, seq_lens, workspace_manager=workspace)
    assert route.folded and not route.padded
    buffer = workspace._buffer.untyped_storage().data_ptr()
    # two tokens: an output of its own; one token (aiter folds in place): the workspace's
    assert outputs[0] != buffer and outputs[1] == buffer
