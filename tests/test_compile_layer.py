"""`MLAAttention.forward` inside a model under `torch.compile(fullgraph=True)`.

The compiled forward is one opaque op, ``torch.ops.mla_multi.mla_attention``,
whose kernel runs the eager forward with the current step of q's device
(`MLAAttention.plan` / `mla_multi.set_step`).  CPU only, float32 with the
REFERENCE backend; Inductor compiles the Linear layers around the op with the
host C++ compiler, so the shapes are tiny.  Compiled steps are compared with
eager steps on a separate copy of the cache (outputs and cache contents) and
with naive float64 MLA (`mla_multi.testing`); caches start as NaN so that a
wrong slot shows.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import mla_multi as mm
from mla_multi import library
from mla_multi.metadata import build_prefill_metadata
from mla_multi.testing import PagedScenario, relative_error

DIMS = mm.MLADims(2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
BLOCK, NUM_BLOCKS, MAX_BLOCKS = 4, 64, 12
HIDDEN = 12
# context chunks of 12 tokens shared by the prefills with context (4 each for 2 or 3 of them, block-rounded)
WORKSPACE_TOKENS = 12
CPU = torch.device("cpu")

# Requests 0-3 get histories first (prefills without context); each step below then runs
# eagerly and compiled on copies of the same cache.
HISTORY = [(0, 13), (1, 6), (2, 9), (3, 5)]
STEPS = {
    "decode": [(0, 1), (1, 1), (2, 1), (3, 1)],
    "prefill": [(0, 5), (2, 7)],  # context 13 and 9: chunks of 4 tokens each
    "mixed": [(0, 1), (1, 1), (2, 6), (3, 4), (4, 7)],  # two decodes, two prefills with context, one without
}


pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def assert_same(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    """Compiled against eager: equal up to float32 rounding (1e-5 relative to the largest entry)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    assert torch.isfinite(out).all(), "non-finite values in the output"
    torch.testing.assert_close(out, ref, rtol=rtol, atol=rtol * ref.abs().max().item())


def assert_same_cache(cache: torch.Tensor, ref: torch.Tensor) -> None:
    """The cache written by the compiled step is the eager one, slot by slot (NaN where never written)."""
    torch.testing.assert_close(cache, ref, rtol=0, atol=0, equal_nan=True)


class Model(torch.nn.Module):
    """Linear -> MLAAttention.forward -> Linear: q comes from x; the new latent rows are the step's."""

    def __init__(self, layer: mm.MLAAttention) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin_q = torch.nn.Linear(HIDDEN, DIMS.num_heads * DIMS.qk_head_dim)
        self.lin_o = torch.nn.Linear(DIMS.num_heads * DIMS.v_head_dim, HIDDEN)
        self.attn = layer

    def forward(self, x, kv_c, k_pe, kv_cache, metadata=None):
        q = self.lin_q(x).view(x.shape[0], DIMS.num_heads, DIMS.qk_head_dim)
        return self.lin_o(self.attn.forward(q, kv_c, k_pe, kv_cache, metadata))

    def reference(self, scene: PagedScenario, requests, x) -> torch.Tensor:
        """float64 naive MLA of the step just scheduled, between the two Linear layers (q rounded as eagerly)."""
        with torch.no_grad():
            q = self.lin_q(x).view(x.shape[0], DIMS.num_heads, DIMS.qk_head_dim)
        out64 = scene.reference(requests, q, self.attn.scale, self.attn.kv_b_proj_weight)
        return torch.nn.functional.linear(out64, self.lin_o.weight.double(), self.lin_o.bias.double())


def make_model(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(
        DIMS.num_heads * (DIMS.qk_nope_head_dim + DIMS.v_head_dim), DIMS.kv_lora_rank, generator=generator,
        dtype=torch.float64,
    ) / DIMS.kv_lora_rank**0.5
    layer = mm.MLAAttention(
        DIMS, DIMS.qk_head_dim**-0.5, weight.float(), block_size=BLOCK, max_model_len=256, max_num_seqs=8,
        workspace_tokens=WORKSPACE_TOKENS,
    )
    assert layer.backends() == {"prefill": "REFERENCE", "decode": "REFERENCE"}
    return Model(layer)


def scene_with_history(model: Model, seed: int = 0):
    """(scene, NaN-poisoned cache holding HISTORY, written by the eager layer)."""
    scene = PagedScenario(DIMS, BLOCK, NUM_BLOCKS, CPU, torch.float32, seed=seed)
    cache = torch.full((NUM_BLOCKS, BLOCK, DIMS.kv_cache_width), float("nan"))
    metadata, q, kv_c, k_pe = scene.step(HISTORY, max_blocks=MAX_BLOCKS)
    with torch.inference_mode():
        model.attn.forward(q, kv_c, k_pe, cache, metadata)
    return scene, cache


def next_step(scene: PagedScenario, requests, seed: int):
    """(metadata, x, kv_c, k_pe) of a step; the block table is MAX_BLOCKS wide whatever the batch."""
    metadata, _, kv_c, k_pe = scene.step(requests, max_blocks=MAX_BLOCKS)
    x = torch.randn(metadata.num_actual_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return metadata, x, kv_c, k_pe


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("kind", list(STEPS))
def test_compiled_step_matches_eager_float64_and_writes_the_same_cache(kind):
    model = make_model()
    scene, cache = scene_with_history(model)
    requests = STEPS[kind]
    metadata, x, kv_c, k_pe = next_step(scene, requests, seed=1)
    if kind != "decode":
        chunks = build_prefill_metadata(metadata, WORKSPACE_TOKENS).chunked_context
        assert chunks is not None and chunks.num_chunks >= 2, chunks
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    compiled = torch.compile(model, fullgraph=True)
    with torch.inference_mode():
        model.attn.plan(metadata)
        y_eager = model(x, kv_c, k_pe, eager_cache, metadata)
        y = compiled(x, kv_c, k_pe, compiled_cache, metadata)
    assert_same(y, y_eager)
    assert_same_cache(compiled_cache, eager_cache)
    assert not torch.equal(compiled_cache.nan_to_num(7.0), cache.nan_to_num(7.0)), "the step wrote nothing"
    assert relative_error(y, model.reference(scene, requests, x)) < 1e-5
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_new_lengths_and_batch_compositions_do_not_recompile():
    """dynamic=True: one graph for every step (no guard on the metadata, which the graph never sees).

    The first step has 5 tokens: with 4 (the block size) Dynamo's duck sizing would make the token count
    and kv_cache.shape[1] one symbol, and the next step would compile once more. Steps of 1 token would
    too (sizes 0 and 1 are specialised).
    """
    model = make_model()
    scene, cache = scene_with_history(model)
    eager_cache = cache.clone()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    steps = [
        [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1)],
        STEPS["decode"],
        [(0, 3), (1, 4)],
        STEPS["mixed"],
        [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)],
        [(2, 1), (3, 1), (6, 11), (0, 2)],
        [(1, 9), (5, 2), (4, 3)],
    ]
    with torch.inference_mode():
        for index, requests in enumerate(steps):
            metadata, x, kv_c, k_pe = next_step(scene, requests, seed=10 + index)
            model.attn.plan(metadata)
            y = compiled(x, kv_c, k_pe, cache, metadata)
            y_eager = model(x, kv_c, k_pe, eager_cache, metadata)
            assert_same(y, y_eager)
            assert_same_cache(cache, eager_cache)
            assert relative_error(y, model.reference(scene, requests, x)) < 1e-5, requests
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


# --------------------------------------------------------------------------- the graph


class RecordingBackend:
    """Keeps the FX graphs Dynamo hands it and the ATen graphs AOTAutograd makes of them; runs the latter."""

    def __init__(self):
        self.dynamo_graphs, self.aten_graphs = [], []
        self._aot = aot_autograd(fw_compiler=self._forward)

    def _forward(self, gm, example_inputs):
        self.aten_graphs.append(gm)
        return gm.forward

    def __call__(self, gm, example_inputs):
        self.dynamo_graphs.append(gm)
        return self._aot(gm, example_inputs)


def _name(target) -> str:
    return getattr(target, "__name__", None) or str(target)


def test_graph_holds_the_layer_as_one_opaque_node():
    model = make_model()
    scene, cache = scene_with_history(model)
    backend = RecordingBackend()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    metadata, x, kv_c, k_pe = next_step(scene, STEPS["mixed"], seed=2)
    with torch.inference_mode():
        model.attn.plan(metadata)
        y = compiled(x, kv_c, k_pe, cache.clone(), None)  # metadata None: the graph does not read it
        assert_same(y, model(x, kv_c, k_pe, cache.clone(), metadata))
    (dynamo_graph,) = backend.dynamo_graphs
    (aten_graph,) = backend.aten_graphs

    # Dynamo's graph: the Linear layers, the view of q, the output buffer and the op with the layer's id.
    nodes = [n for n in dynamo_graph.graph.nodes if n.op in ("call_function", "call_method")]
    ops = [n for n in nodes if n.target is torch.ops.mla_multi.mla_attention]
    assert len(ops) == 1, [n.target for n in nodes]
    assert ops[0].args[-1] == model.attn.layer_id and isinstance(ops[0].args[-1], int)
    others = sorted({_name(n.target) for n in nodes if n is not ops[0]})
    assert set(others) <= {"linear", "view", "new_empty"}, others

    # ATen (functionalized): the op once, behind auto_functionalized, and only the Linear layers' math besides.
    targets = [n.target for n in aten_graph.graph.nodes if n.op == "call_function"]
    functionalized = [
        n for n in aten_graph.graph.nodes if n.op == "call_function" and "auto_functionalized" in _name(n.target)
    ]
    assert len(functionalized) == 1 and functionalized[0].args[0] is torch.ops.mla_multi.mla_attention.default
    aten = sorted({_name(t) for t in targets} - {_name(functionalized[0].target), "getitem"})
    assert set(aten) <= {"t.default", "addmm.default", "view.default", "new_empty.default", "slice.Tensor",
                         "copy_.default"}, aten


# --------------------------------------------------------------------------- errors


def test_compiled_step_runs_the_data_checks():
    """A bad block-table entry in the current step raises ValueError from the compiled call."""
    model = make_model()
    scene, cache = scene_with_history(model)
    compiled = torch.compile(model, fullgraph=True)
    metadata, x, kv_c, k_pe = next_step(scene, STEPS["decode"], seed=3)
    with torch.inference_mode():
        model.attn.plan(metadata)
        assert_same(compiled(x, kv_c, k_pe, cache.clone(), metadata), model(x, kv_c, k_pe, cache.clone(), metadata))
        bad_table = metadata.block_table.clone()
        bad_table[1, 0] = NUM_BLOCKS + 3
        bad = mm.CommonAttentionMetadata.from_lengths(
            metadata.query_lens_cpu, metadata.seq_lens_cpu, bad_table, BLOCK
        )
        with pytest.raises(ValueError, match=r"block_table\[1\] uses blocks"):
            model(x, kv_c, k_pe, cache.clone(), bad)  # eagerly
        mm.set_step(bad)
        with pytest.raises(ValueError, match=r"block_table\[1\] uses blocks"):
            compiled(x, kv_c, k_pe, cache.clone(), bad)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compiled_forward_without_a_current_step_says_what_to_call():
    model = make_model()
    scene, cache = scene_with_history(model)
    compiled = torch.compile(model, fullgraph=True)
    metadata, x, kv_c, k_pe = next_step(scene, [(0, 2), (1, 3)], seed=4)
    with torch.inference_mode():
        assert library.current_metadata(CPU) is None
        with pytest.raises(ValueError, match=r"no current step on cpu .*call layer\.plan\(metadata\) or "
                                             r"mla_multi\.set_step\(metadata\)"):
            compiled(x, kv_c, k_pe, cache, metadata)
        # set_step as a context manager: the step holds inside, the previous (none) comes back after
        with mm.set_step(metadata):
            assert library.current_metadata(CPU) is metadata
            y = compiled(x, kv_c, k_pe, cache, metadata)
        assert library.current_metadata(CPU) is None
        assert relative_error(y, model.reference(scene, [(0, 2), (1, 3)], x)) < 1e-5
        # a step left current from another batch: the token count tells
        model.attn.plan(metadata)
        assert library.current_metadata(CPU) is metadata
        other, x2, kv_c2, k_pe2 = next_step(scene, [(0, 1), (1, 1), (2, 4)], seed=5)
        with pytest.raises(ValueError, match=r"q has 6 tokens, the current step on cpu 5"):
            compiled(x2, kv_c2, k_pe2, cache, other)


def test_layer_ids_are_unique_and_a_freed_layer_is_an_error():
    first, second = make_model().attn, make_model().attn
    assert isinstance(first.layer_id, int) and second.layer_id > first.layer_id
    assert library.layer_by_id(first.layer_id) is first
    scene = PagedScenario(DIMS, BLOCK, NUM_BLOCKS, CPU, torch.float32)
    metadata, q, kv_c, k_pe = scene.step([(0, 3)], max_blocks=MAX_BLOCKS)
    second.plan(metadata)
    cache, out = torch.zeros(NUM_BLOCKS, BLOCK, DIMS.kv_cache_width), torch.zeros(3, DIMS.num_heads * DIMS.v_head_dim)
    freed = second.layer_id
    del second
    gc.collect()
    with pytest.raises(ValueError, match=rf"layer_id={freed}: that MLAAttention was freed"):
        torch.ops.mla_multi.mla_attention(q, kv_c, k_pe, cache, out, freed)
    with pytest.raises(ValueError, match="the layer_id of a live MLAAttention"):
        torch.ops.mla_multi.mla_attention(q, kv_c, k_pe, cache, out, 10**9)
    # the live layer, called as the op directly, is its eager forward
    torch.ops.mla_multi.mla_attention(q, kv_c, k_pe, cache, out, first.layer_id)
    assert torch.equal(out, first.forward(q, kv_c, k_pe, cache.clone(), metadata))


def test_opcheck_and_schema():
    model = make_model()
    scene, cache = scene_with_history(model)
    metadata, _, kv_c, k_pe = scene.step(STEPS["mixed"], max_blocks=MAX_BLOCKS)
    q = torch.randn(metadata.num_actual_tokens, DIMS.num_heads, DIMS.qk_head_dim)
    model.attn.plan(metadata)
    out = torch.zeros(metadata.num_actual_tokens, DIMS.num_heads * DIMS.v_head_dim)
    torch.library.opcheck(
        torch.ops.mla_multi.mla_attention.default, (q, kv_c, k_pe, cache.nan_to_num(0.0), out, model.attn.layer_id),
        test_utils=["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                    "test_aot_dispatch_dynamic"],
    )
    schema = torch.ops.mla_multi.mla_attention.default._schema
    assert str(schema) == "mla_multi::" + library.ATTENTION_SCHEMA
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"kv_cache", "output"} and schema.returns == []
    assert torch.Tag.cudagraph_unsafe in torch.ops.mla_multi.mla_attention.default.tags


# --------------------------------------------------------------------------- modes


def test_reduce_overhead_decode_step_on_cpu():
    """mode="reduce-overhead" on CPU: no CUDA graphs there; the step runs and matches eager."""
    model = make_model()
    scene, cache = scene_with_history(model)
    eager_cache = cache.clone()
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    with torch.inference_mode():
        for index, requests in enumerate([STEPS["decode"], STEPS["decode"]]):
            metadata, x, kv_c, k_pe = next_step(scene, requests, seed=20 + index)
            model.attn.plan(metadata)
            y = compiled(x, kv_c, k_pe, cache, metadata)
            y_eager = model(x, kv_c, k_pe, eager_cache, metadata)
            assert_same(y, y_eager)
            assert_same_cache(cache, eager_cache)
            assert relative_error(y, model.reference(scene, requests, x)) < 1e-5
