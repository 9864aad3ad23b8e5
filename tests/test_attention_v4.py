"""`MLAAttentionV4`: the DeepSeek-V4 layer against naive float64 V4 attention written here.

Each step writes its rows into the window cache (and the compressor's rows into the main cache), then
every token attends, in one softmax, to its top-k slots of the main cache and to the window of its
request's most recent tokens, scaled by the sink. The reference reads both caches dequantised (float64),
builds every token's window from its position and the block table itself, and applies the sink as
FlashMLA defines it: out * exp(lse) / (exp(lse) + exp(sink)). CPU, REFERENCE backend.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import mla_multi as mm
from mla_multi import cache_formats, library
from mla_multi.testing import capture_graph, relative_error

CPU = torch.device("cpu")
HEADS = 4
BLOCK = 8          # tokens per window-cache block (the step metadata's block size)
NUM_BLOCKS = 96    # window-cache blocks
MAIN_BLOCKS, MAIN_BLOCK = 24, 16  # main-cache blocks and their size
MAX_BLOCKS = 12    # block-table width: requests up to 96 tokens
SCALE = 512**-0.5
BOUND = {"fp8_ds_mla_v4": 6e-2, "fp8_ds_mla_v41": 6e-2, "fp4_ds_mla_v41": 0.2}  # a row's quantisation error


pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def clone_cache(cache: torch.Tensor, device=None) -> torch.Tensor:
    """A copy with the cache's strides (a V4 cache's blocks are padded: `clone` and `.cpu()` would drop the
    padding), on `device` (the cache's by default)."""
    copy = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype, device=device or cache.device)
    return copy.copy_(cache)


class Scene:
    """A V4 layer, its caches and requests that grow step by step; the float64 reference of each step."""

    def __init__(self, *, topk=16, window=8, kv_format="fp8_ds_mla_v4", window_kv_format=None,
                 dtype=torch.float32, seed=0, sink=True, workspace_tokens=None, device=CPU, heads=HEADS):
        self.layer = mm.MLAAttentionV4(
            heads, SCALE, block_size=BLOCK, max_model_len=MAX_BLOCKS * BLOCK, max_num_seqs=8, topk=topk,
            window_size=window, kv_format=kv_format, window_kv_format=window_kv_format, dtype=dtype,
            workspace_tokens=workspace_tokens, device=device,
        )
        self.device, self.heads = device, heads
        self.generator = torch.Generator().manual_seed(seed)
        if sink:
            self.layer.attn_sink.data = (torch.randn(heads, generator=self.generator) + 1.0).to(device)
        self.dtype = dtype
        self.window_cache = self.layer.allocate_window_cache(NUM_BLOCKS) if window else None
        self.kv_cache = self.layer.allocate_kv_cache(MAIN_BLOCKS, MAIN_BLOCK) if topk else None
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=self.generator).tolist()
        self.free_slots = torch.randperm(MAIN_BLOCKS * MAIN_BLOCK, generator=self.generator).tolist()
        self.written_slots: list[int] = []
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.generator, dtype=torch.float64).to(self.dtype).to(self.device)

    def step(self, requests, *, decode_threshold=1, compressed=3, reorder=False):
        """The inputs of a step of (request, new tokens) pairs, decodes first (unless `reorder`)."""
        query_lens, seq_lens, table = [], [], []
        for request, new in requests:
            length = self.lengths.get(request, 0) + new
            blocks = self.tables.setdefault(request, [])
            while len(blocks) * BLOCK < length:
                blocks.append(self.free_blocks.pop())
            self.lengths[request] = length
            query_lens.append(new)
            seq_lens.append(length)
            table.append(blocks + [0] * (MAX_BLOCKS - len(blocks)))
        block_table = torch.tensor(table, dtype=torch.int32, device=self.device)
        metadata = mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, block_table, BLOCK,
                                                           decode_threshold, reorder=reorder)
        tokens = sum(query_lens)
        inputs = {"q": self.randn(tokens, self.heads, 512), "kv": self.randn(tokens, 512), "metadata": metadata,
                  "requests": list(requests)}
        if self.layer.topk is not None:
            if compressed:
                slots = [self.free_slots.pop() for _ in range(compressed)]
                inputs["compressed_kv"] = self.randn(compressed, 512)
                inputs["compressed_slot_mapping"] = torch.tensor(slots, dtype=torch.int64, device=self.device)
                self.written_slots += slots
            topk = self.layer.topk
            pool = torch.tensor(self.written_slots, dtype=torch.int32)
            picks = pool[torch.randint(len(pool), (tokens, topk), generator=self.generator)]
            gaps = torch.rand(tokens, topk, generator=self.generator) < 0.2
            picks[gaps] = -1                             # no token there
            picks[:, 1] = picks[:, 0]                    # a duplicate counts twice
            inputs["topk_indices"] = picks.to(self.device)
            inputs["topk_length"] = torch.randint(topk // 2, topk + 1, (tokens,), generator=self.generator,
                                                  dtype=torch.int32).to(self.device)
        return inputs

    def run(self, inputs, *, layer=None, kv_cache=None, window_cache=None):
        layer = layer or self.layer
        keywords = {k: inputs[k] for k in ("topk_indices", "topk_length", "compressed_kv", "compressed_slot_mapping")
                    if k in inputs}
        with torch.inference_mode():
            return layer(inputs["q"], inputs["kv"], self.kv_cache if kv_cache is None else kv_cache,
                         self.window_cache if window_cache is None else window_cache, inputs["metadata"], **keywords)

    def token_positions(self, requests):
        """[(request, position)] of the step's tokens in the caller's order."""
        return [(r, self.lengths[r] - new + i) for r, new in requests for i in range(new)]

    def window_slots(self, request, position):
        width = self.layer.window_size
        return [self.tables[request][p // BLOCK] * BLOCK + p % BLOCK
                for p in range(max(0, position - width + 1), position + 1)]

    def reference(self, inputs) -> torch.Tensor:
        """Naive float64 V4 attention of the step just run (caches read after its writes), [T, N * 512]."""
        layer = self.layer
        q = inputs["q"].double().cpu()
        sink = layer.attn_sink.double().cpu()
        kv_cache = None if self.kv_cache is None else clone_cache(self.kv_cache, CPU)
        window_cache = None if self.window_cache is None else clone_cache(self.window_cache, CPU)
        out = torch.zeros(q.shape[0], self.heads, 512, dtype=torch.float64)
        for t, (request, position) in enumerate(self.token_positions(inputs["requests"])):
            rows = []
            if layer.topk is not None:
                count = int(inputs["topk_length"][t])
                slots = [s for s in inputs["topk_indices"][t, :count].tolist() if s >= 0]
                if slots:
                    rows.append(cache_formats.get_format(layer.kv_format).read_rows(
                        kv_cache, torch.float64, torch.tensor(slots)))
            if layer.window_size:
                rows.append(cache_formats.get_format(layer.window_kv_format).read_rows(
                    window_cache, torch.float64, torch.tensor(self.window_slots(request, position))))
            if not rows:
                continue
            keys = torch.cat(rows)
            scores = q[t] @ keys.T * SCALE                        # [N, rows]
            lse = torch.logsumexp(scores, dim=1, keepdim=True)
            attended = torch.softmax(scores, dim=1) @ keys        # [N, 512]
            out[t] = attended * torch.sigmoid(lse - sink.unsqueeze(1))  # exp(lse) / (exp(lse) + exp(sink))
        return out.reshape(q.shape[0], self.heads * 512)

    def check_writes(self, inputs) -> None:
        """The step's rows sit where their positions (window) and slots (main) say, within the format's error."""
        layer = self.layer
        if layer.window_size:
            slots = [self.tables[r][p // BLOCK] * BLOCK + p % BLOCK
                     for r, p in self.token_positions(inputs["requests"])]
            stored = cache_formats.get_format(layer.window_kv_format).read_rows(
                clone_cache(self.window_cache, CPU), torch.float64, torch.tensor(slots))
            assert relative_error(stored, inputs["kv"].double()) < BOUND[layer.window_kv_format]
        if "compressed_kv" in inputs:
            stored = cache_formats.get_format(layer.kv_format).read_rows(
                clone_cache(self.kv_cache, CPU), torch.float64, inputs["compressed_slot_mapping"].cpu())
            assert relative_error(stored, inputs["compressed_kv"].double()) < BOUND[layer.kv_format]


HISTORY = [(0, 40), (1, 7), (2, 19)]
STEPS = {
    "decode": ([(0, 1), (1, 1), (2, 1)], 1),
    "mtp_decode": ([(0, 3), (1, 8), (2, 2)], 8),       # MTP: up to 8 new tokens a decode request
    "prefill": ([(0, 13), (3, 30)], 1),                # one with cached context, one without
    "mixed": ([(1, 1), (2, 4), (0, 9), (3, 21)], 4),   # a decode, an MTP decode, two prefills
}


def scene_with_history(**options) -> Scene:
    """A scene whose requests 0-2 hold HISTORY (and 8 compressed rows), written by the layer."""
    scene = Scene(**options)
    inputs = scene.step(HISTORY, compressed=8)
    scene.run(inputs)
    return scene


def check_step(scene: Scene, inputs, out, tolerance=1e-5) -> None:
    assert out.shape == (inputs["q"].shape[0], scene.heads * 512) and out.dtype == scene.dtype
    assert torch.isfinite(out).all()
    scene.check_writes(inputs)
    error = relative_error(out, scene.reference(inputs))
    assert error < tolerance, error


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("kind", list(STEPS))
def test_step_against_float64(kind):
    scene = scene_with_history()
    requests, threshold = STEPS[kind]
    inputs = scene.step(requests, decode_threshold=threshold)
    out = scene.run(inputs)
    check_step(scene, inputs, out)
    step = scene.layer._step(inputs["metadata"])
    decode_tokens = sum(n for _, n in requests if n <= threshold)
    assert step["num_decode_tokens"] == decode_tokens
    assert bool(step["prefill_chunks"]) == (decode_tokens < inputs["q"].shape[0])


@pytest.mark.parametrize("formats", [("fp8_ds_mla_v4", None), ("fp8_ds_mla_v41", None),
                                     ("fp8_ds_mla_v41", "fp4_ds_mla_v41")], ids=["584", "528", "528+288"])
def test_cache_formats(formats):
    kv_format, window_kv_format = formats
    scene = scene_with_history(kv_format=kv_format, window_kv_format=window_kv_format)
    assert scene.kv_cache.shape[-1] == cache_formats.get_format(kv_format).bytes_per_token
    assert scene.window_cache.shape[-1] == cache_formats.get_format(window_kv_format or kv_format).bytes_per_token
    inputs = scene.step(STEPS["mixed"][0], decode_threshold=4)
    check_step(scene, inputs, scene.run(inputs))


def test_the_window_segment_empty():
    """window_size=0: the top-k segment alone; no window cache, kv is not written anywhere."""
    scene = scene_with_history(window=0)
    assert scene.window_cache is None
    inputs = scene.step(STEPS["mixed"][0], decode_threshold=4)
    check_step(scene, inputs, scene.run(inputs))
    with pytest.raises(ValueError, match="window_size=0"):
        scene.layer.allocate_window_cache(4)


def test_the_window_segment_full_and_partial():
    """A window longer than every request (each token sees its whole request) and one of 3 tokens."""
    for window in (MAX_BLOCKS * BLOCK, 3):
        scene = scene_with_history(window=window)
        inputs = scene.step(STEPS["mixed"][0], decode_threshold=4)
        check_step(scene, inputs, scene.run(inputs))
        lengths = scene.layer._step(inputs["metadata"])["window_lengths"]
        positions = [p for _, p in scene.token_positions(inputs["requests"])]
        assert lengths.tolist() == [min(p + 1, window) for p in positions]


def test_window_only_layer():
    """topk=None (V4's layers without compression): the window is the only segment, read as the main one."""
    scene = scene_with_history(topk=None, window=5)
    assert scene.kv_cache is None
    inputs = scene.step(STEPS["mixed"][0], decode_threshold=4)
    check_step(scene, inputs, scene.run(inputs))
    with pytest.raises(ValueError, match="topk_indices given to an MLAAttentionV4 without a top-k segment"):
        scene.layer(inputs["q"], inputs["kv"], None, scene.window_cache, inputs["metadata"],
                    topk_indices=torch.zeros(inputs["q"].shape[0], 2, dtype=torch.int32))


def test_the_sink():
    """The sink scales each head's rows by exp(lse) / (exp(lse) + exp(sink)); -inf (the initial value)
    changes nothing; +inf gives zeros. It is the module's float32 parameter."""
    scene = scene_with_history(sink=False)
    layer = scene.layer
    assert "attn_sink" in layer.state_dict() and layer.attn_sink.dtype == torch.float32
    assert torch.isneginf(layer.attn_sink).all()
    inputs = scene.step(STEPS["mixed"][0], decode_threshold=4)
    window, kv_cache = clone_cache(scene.window_cache), clone_cache(scene.kv_cache)
    plain = scene.run(inputs)
    check_step(scene, inputs, plain)
    layer.load_state_dict({"attn_sink": torch.tensor([0.5, -1.0, 3.0, 8.0])})
    sunk = scene.run(inputs, kv_cache=clone_cache(kv_cache), window_cache=clone_cache(window))
    check_step(scene, inputs, sunk)
    # head 3's large sink takes most of the mass; head 1's little
    by_head = (sunk.view(-1, HEADS, 512).norm(dim=(0, 2)) / plain.view(-1, HEADS, 512).norm(dim=(0, 2)))
    assert by_head[3] < by_head[1] < 1.0
    layer.attn_sink.data.fill_(math.inf)
    assert scene.run(inputs, kv_cache=clone_cache(kv_cache), window_cache=clone_cache(window)).abs().max() == 0


def test_prefill_in_chunks_matches_one_chunk():
    """workspace_tokens bounds the prefill entries attended by one call: several chunks give the same rows."""
    small = scene_with_history(workspace_tokens=1)  # one token a chunk
    large = scene_with_history()
    requests, threshold = STEPS["mixed"]
    a, b = small.step(requests, decode_threshold=threshold), large.step(requests, decode_threshold=threshold)
    chunks = small.layer._step(a["metadata"])["prefill_chunks"]
    assert len(chunks) == a["q"].shape[0] - sum(n for _, n in requests if n <= threshold)
    assert len(large.layer._step(b["metadata"])["prefill_chunks"]) == 1
    out_small, out_large = small.run(a), large.run(b)
    torch.testing.assert_close(out_small, out_large, rtol=1e-6, atol=1e-6)
    check_step(small, a, out_small)


def test_float64_and_bfloat16():
    scene = scene_with_history(dtype=torch.float64)
    inputs = scene.step(STEPS["mixed"][0], decode_threshold=4)
    check_step(scene, inputs, scene.run(inputs), tolerance=1e-12)
    scene = scene_with_history(dtype=torch.bfloat16)
    inputs = scene.step(STEPS["mixed"][0], decode_threshold=4)
    check_step(scene, inputs, scene.run(inputs), tolerance=1e-2)


def test_requests_in_the_callers_order():
    """reorder=True: q, kv, topk_indices and the output in the caller's order (a prefill before a decode)."""
    scene = scene_with_history()
    inputs = scene.step([(0, 9), (1, 1), (3, 21), (2, 1)], reorder=True)
    assert not inputs["metadata"].batch_order.identity
    check_step(scene, inputs, scene.run(inputs))


def test_every_step_writes_and_later_steps_read_it():
    """Three steps in a row: the windows reach back into rows earlier steps wrote."""
    scene = scene_with_history(window=12)
    for requests, threshold in (STEPS["decode"], STEPS["mtp_decode"], STEPS["mixed"]):
        inputs = scene.step(requests, decode_threshold=threshold)
        check_step(scene, inputs, scene.run(inputs))


def test_grad_mode_runs_and_backward_says_why_not():
    scene = scene_with_history()
    inputs = scene.step(STEPS["decode"][0], compressed=0)
    q = inputs["q"].clone().requires_grad_()
    out = scene.layer(q, inputs["kv"], scene.kv_cache, scene.window_cache, inputs["metadata"],
                      topk_indices=inputs["topk_indices"], topk_length=inputs["topk_length"])
    assert out.requires_grad
    check_step(scene, inputs, out.detach())
    with pytest.raises(RuntimeError, match="inference-only"):
        out.sum().backward()


def test_to_keeps_the_sink_float32_and_follows_the_dtype():
    scene = scene_with_history()
    layer = scene.layer.to(torch.float64)
    assert layer.dtype == torch.float64 and layer.attn_sink.dtype == torch.float32
    inputs = scene.step(STEPS["decode"][0])
    scene.dtype = torch.float64
    for name in ("q", "kv", "compressed_kv"):
        inputs[name] = inputs[name].double()
    check_step(scene, inputs, scene.run(inputs), tolerance=1e-12)


def test_backends_are_the_registrys_v4_choice():
    scene = Scene()
    assert scene.layer.backends() == {"sparse_decode_v4": "REFERENCE", "sparse_prefill_v4": "REFERENCE"}
    assert "sparse_decode_v4" in repr(scene.layer)
    with pytest.raises(mm.NoBackendError):
        Scene(topk=16, window=8).layer.__class__(
            HEADS, SCALE, block_size=BLOCK, max_model_len=64, max_num_seqs=2, topk=16, decode_backend="TRITON",
            dtype=torch.float32)


# --------------------------------------------------------------------------- torch.compile


class Model(torch.nn.Module):
    """Linear -> MLAAttentionV4.forward -> Linear."""

    def __init__(self, layer) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin_q = torch.nn.Linear(12, HEADS * 512)
        self.lin_o = torch.nn.Linear(HEADS * 512, 12)
        self.attn = layer

    def forward(self, x, kv, kv_cache, window_cache, topk_indices, topk_length, compressed_kv, compressed_slots,
                metadata=None):
        q = self.lin_q(x).view(x.shape[0], HEADS, 512)
        out = self.attn(q, kv, kv_cache, window_cache, metadata, topk_indices=topk_indices, topk_length=topk_length,
                        compressed_kv=compressed_kv, compressed_slot_mapping=compressed_slots)
        return self.lin_o(out)


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_compile_fullgraph_matches_eager(kind):
    scene = scene_with_history(window_kv_format=None)
    model = Model(scene.layer)
    compiled = torch.compile(model, fullgraph=True)
    requests, threshold = STEPS[kind]
    inputs = scene.step(requests, decode_threshold=threshold)
    x = torch.randn(inputs["q"].shape[0], 12, generator=torch.Generator().manual_seed(1))
    args = [inputs["kv"], None, None, inputs["topk_indices"], inputs["topk_length"], inputs["compressed_kv"],
            inputs["compressed_slot_mapping"]]
    eager_caches = (clone_cache(scene.kv_cache), clone_cache(scene.window_cache))
    with torch.inference_mode():
        scene.layer.plan(inputs["metadata"])
        args[1:3] = eager_caches
        y_eager = model(x, *args, metadata=inputs["metadata"])
        args[1:3] = scene.kv_cache, scene.window_cache
        y = compiled(x, *args)  # metadata None: the compiled forward runs the current step
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5 * y_eager.abs().max().item())
    assert torch.equal(scene.window_cache, eager_caches[1]) and torch.equal(scene.kv_cache, eager_caches[0])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    # the attention inside, against float64
    with torch.no_grad():
        inputs["q"] = model.lin_q(x).view(x.shape[0], HEADS, 512)
        attn = scene.run(inputs)
    scene.check_writes(inputs)
    assert relative_error(attn, scene.reference(inputs)) < 1e-5


def test_compiled_steps_of_new_lengths_do_not_recompile():
    """dynamic=True: one graph for steps of any batch (the metadata never enters the graph)."""
    scene = scene_with_history()
    model = Model(scene.layer)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    steps = [([(0, 1), (1, 1), (2, 1), (3, 2)], 1, 2), (STEPS["mtp_decode"][0], 8, 3), (STEPS["mixed"][0], 4, 4),
             ([(4, 17), (1, 3)], 1, 5)]
    with torch.inference_mode():
        for index, (requests, threshold, compressed) in enumerate(steps):
            inputs = scene.step(requests, decode_threshold=threshold, compressed=compressed)
            x = torch.randn(inputs["q"].shape[0], 12, generator=torch.Generator().manual_seed(index))
            eager_caches = (clone_cache(scene.kv_cache), clone_cache(scene.window_cache))
            scene.layer.plan(inputs["metadata"])
            rest = (inputs["topk_indices"], inputs["topk_length"], inputs["compressed_kv"],
                    inputs["compressed_slot_mapping"])
            y_eager = model(x, inputs["kv"], *eager_caches, *rest, metadata=inputs["metadata"])
            y = compiled(x, inputs["kv"], scene.kv_cache, scene.window_cache, *rest)
            torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5 * y_eager.abs().max().item())
            assert torch.equal(scene.window_cache, eager_caches[1]) and torch.equal(scene.kv_cache, eager_caches[0])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compile_graph_holds_one_opaque_node_and_the_schema():
    scene = scene_with_history()
    inputs = scene.step(STEPS["decode"][0])
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(Model(scene.layer), fullgraph=True, backend=backend)
    x = torch.randn(inputs["q"].shape[0], 12)
    with torch.inference_mode():
        scene.layer.plan(inputs["metadata"])
        compiled(x, inputs["kv"], scene.kv_cache, scene.window_cache, inputs["topk_indices"], inputs["topk_length"],
                 None, None)
    (graph,) = graphs
    found = [n for n in graph.graph.nodes if n.target is torch.ops.mla_multi.mla_attention_v4]
    assert len(found) == 1 and found[0].args[-1] == scene.layer.layer_id
    schema = torch.ops.mla_multi.mla_attention_v4.default._schema
    assert str(schema) == "mla_multi::" + library.V4_ATTENTION_SCHEMA
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"kv_cache", "window_cache", "output"}
    assert torch.Tag.cudagraph_unsafe in torch.ops.mla_multi.mla_attention_v4.default.tags


def test_opcheck():
    # V4.1's blocks are unpadded (opcheck's AOT tests copy the mutated caches with their default strides)
    scene = scene_with_history(kv_format="fp8_ds_mla_v41")
    inputs = scene.step(STEPS["mixed"][0], decode_threshold=4)
    scene.layer.plan(inputs["metadata"])
    out = torch.zeros(inputs["q"].shape[0], HEADS * 512)
    torch.library.opcheck(
        torch.ops.mla_multi.mla_attention_v4.default,
        (inputs["q"], inputs["kv"], scene.kv_cache, scene.window_cache, out, inputs["topk_indices"],
         inputs["topk_length"], inputs["compressed_kv"], inputs["compressed_slot_mapping"], scene.layer.layer_id),
        test_utils=["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                    "test_aot_dispatch_dynamic"],
    )


def test_compiled_forward_without_a_current_step_says_what_to_call():
    scene = scene_with_history()
    inputs = scene.step(STEPS["decode"][0])
    compiled = torch.compile(Model(scene.layer), fullgraph=True)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"no current step on cpu"):
        compiled(torch.randn(3, 12), inputs["kv"], scene.kv_cache, scene.window_cache, inputs["topk_indices"],
                 None, None, None)


# --------------------------------------------------------------------------- bad arguments


def make(**overrides):
    options = dict(block_size=BLOCK, max_model_len=64, max_num_seqs=4, topk=16, window_size=8, dtype=torch.float32)
    options.update(overrides)
    num_heads, scale = options.pop("num_heads", HEADS), options.pop("scale", SCALE)
    return mm.MLAAttentionV4(num_heads, scale, **options)


@pytest.mark.parametrize("overrides, message", [
    ({"num_heads": 0}, r"num_heads=0; accepted: a positive int"),
    ({"scale": -1.0}, r"scale=-1.0; accepted"),
    ({"block_size": 0}, r"block_size=0"),
    ({"topk": 0}, r"topk=0; accepted: a positive int or None"),
    ({"window_size": -1}, r"window_size=-1; accepted: an int >= 0"),
    ({"topk": None, "window_size": 0}, r"topk=None with window_size=0"),
    ({"kv_format": "fp8_ds_mla"}, r"kv_format='fp8_ds_mla'; accepted: fp8_ds_mla_v4, fp8_ds_mla_v41"),
    ({"kv_format": "fp4_ds_mla_v41"}, r"kv_format='fp4_ds_mla_v41'"),
    ({"window_kv_format": "fp4_ds_mla_v41"}, r"window_kv_format='fp4_ds_mla_v41' beside kv_format='fp8_ds_mla_v4'"),
    ({"topk": None, "kv_format": "fp8_ds_mla_v41", "window_kv_format": "fp4_ds_mla_v41"},
     r"window_kv_format='fp4_ds_mla_v41' serves only as a second segment"),
    ({"dtype": torch.int32}, r"dtype=torch.int32; accepted"),
    ({"workspace_tokens": 0}, r"workspace_tokens=0"),
    ({"decode_backend": "NOPE"}, r"NOPE"),
])
def test_constructor_errors_name_the_argument(overrides, message):
    with pytest.raises((ValueError, mm.NoBackendError, mm.UnknownBackendError), match=message):
        make(**overrides)


def test_forward_errors_name_the_argument():
    scene = scene_with_history()
    layer = scene.layer
    inputs = scene.step(STEPS["mixed"][0], decode_threshold=4)
    q, kv, md = inputs["q"], inputs["kv"], inputs["metadata"]
    topk, lengths = inputs["topk_indices"], inputs["topk_length"]
    kv_cache, window = scene.kv_cache, scene.window_cache
    tokens = q.shape[0]

    def call(**changes):
        args = dict(q=q, kv=kv, kv_cache=kv_cache, window_cache=window, metadata=md, topk_indices=topk,
                    topk_length=lengths)
        args.update(changes)
        with torch.inference_mode():
            return layer(args.pop("q"), args.pop("kv"), args.pop("kv_cache"), args.pop("window_cache"),
                         args.pop("metadata"), **args)

    cases = [
        (dict(q=q[..., :448]), r"^q "),
        (dict(q=q.double()), r"^q "),
        (dict(kv=kv[:, :448]), r"^kv "),
        (dict(kv_cache=window[:, :, :528]), r"kv_cache"),
        (dict(kv_cache=torch.zeros(4, 16, 584)), r"kv_cache"),
        (dict(window_cache=cache_formats.get_format("fp8_ds_mla_v4").allocate(4, 16)),
         r"window_cache has blocks of 16"),
        (dict(window_cache=None), r"window_cache"),
        (dict(topk_indices=None), r"forward needs topk_indices"),
        (dict(topk_indices=topk.long()), r"topk_indices"),
        (dict(topk_indices=torch.zeros(tokens, 17, dtype=torch.int32)), r"topk_indices has 17 entries a token"),
        (dict(topk_indices=torch.full((tokens, 4), MAIN_BLOCKS * MAIN_BLOCK, dtype=torch.int32)),
         r"topk_indices hold slots \[384"),
        (dict(topk_length=lengths[:-1]), r"topk_length"),
        (dict(metadata="step"), r"metadata=str"),
        (dict(compressed_kv=kv[:2]), r"compressed_kv and compressed_slot_mapping go together"),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**changes)
    with pytest.raises(ValueError, match=r"output"):
        call(output=torch.zeros(tokens, HEADS * 128))
    # a step of another block size, and decodes longer than MTP's 8 tokens
    other = mm.CommonAttentionMetadata.from_lengths([1], [5], torch.zeros(1, 4, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match=r"metadata.block_size=16; this layer's block_size"):
        layer.plan(other)
    long = mm.CommonAttentionMetadata.from_lengths([9], [20], torch.zeros(1, 4, dtype=torch.int32), BLOCK, 9)
    with pytest.raises(ValueError, match=r"decode_threshold=9 makes a decode of 9 tokens; accepted: at most 8"):
        layer.plan(long)
    with pytest.raises(ValueError, match=r"metadata=int"):
        layer.plan(3)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_bad_window_block_is_an_error_with_checks_and_nan_rows_without(kind, monkeypatch):
    from mla_multi import checks, errors, ops

    scene = scene_with_history()
    requests, threshold = STEPS[kind]
    inputs = scene.step(requests, decode_threshold=threshold)
    metadata = inputs["metadata"]
    table = metadata.block_table.clone()
    last = scene.lengths[requests[0][0]] - 1
    bad_block = last // BLOCK  # request 0's block of its last token: in the window of its new tokens
    table[0, bad_block] = NUM_BLOCKS + 5
    bad = mm.CommonAttentionMetadata.from_lengths(metadata.query_lens_cpu, metadata.seq_lens_cpu, table, BLOCK,
                                                  threshold)
    inputs["metadata"] = bad
    with pytest.raises(ValueError, match=rf"block_table\[0\] uses blocks .*{NUM_BLOCKS + 5}"):
        scene.run(inputs)
    # without the data checks: the tokens whose window reads the bad block get NaN rows and the flag is set
    monkeypatch.setattr(checks, "data_checks_enabled", lambda device=None: False)
    monkeypatch.setattr(ops, "_PLANS", {})  # the ops' plans made with the checks on keep them
    errors.error_flag(CPU).zero_()
    out = scene.run(inputs).view(-1, HEADS, 512)
    width = scene.layer.window_size
    touches = [r == requests[0][0] and any(q // BLOCK == bad_block for q in range(max(0, p - width + 1), p + 1))
               for r, p in scene.token_positions(inputs["requests"])]
    assert touches.count(True) >= 1 and touches.count(False) >= 1
    for t, bad_token in enumerate(touches):
        assert bool(torch.isnan(out[t]).all()) == bad_token, t
        assert bad_token or bool(torch.isfinite(out[t]).all()), t
    assert int(errors.error_flag(CPU)) & errors.SPARSE_INDEX
    errors.error_flag(CPU).zero_()


def test_demo_v4_on_the_cpu_checks_against_float64(capsys):
    from mla_multi import cli

    assert cli.main(["demo", "--v4", "528+288", "--num-heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "fp8_ds_mla_v41 + window fp4_ds_mla_v41" in out
    assert "sparse_decode_v4=REFERENCE, sparse_prefill_v4=REFERENCE" in out
    assert "up to 4 tokens each" in out and out.splitlines()[-1].endswith("OK")


# --------------------------------------------------------------------------- on a GPU


def _gpu_scene(formats) -> "Scene":
    """A bfloat16 scene on the GPU with DeepSeek-V4 Flash's 64 heads, top-64 and a 16-token window, in the
    (main, window) cache formats given."""
    kv_format, window_kv_format = formats
    return Scene(kv_format=kv_format, window_kv_format=window_kv_format, dtype=torch.bfloat16,
                 device=torch.device("cuda"), heads=64, topk=64, window=16)


@pytest.mark.gpu
@pytest.mark.parametrize("formats", [("fp8_ds_mla_v4", None), ("fp8_ds_mla_v41", "fp4_ds_mla_v41")],
                         ids=["584", "528+288"])
def test_layer_on_the_gpu_against_float64(formats):
    """bfloat16, DeepSeek-V4 Flash's 64 heads, through whichever V4 backends the registry picks on the device;
    decodes, MTP decodes, prefills and a mixed step against float64 over the dequantised caches."""
    scene = _gpu_scene(formats)
    with torch.inference_mode():
        inputs = scene.step(HISTORY, compressed=8)
        scene.layer.plan(inputs["metadata"])
        check_step(scene, inputs, scene.run(inputs), tolerance=1e-2)
        for requests, threshold in STEPS.values():
            inputs = scene.step(requests, decode_threshold=threshold)
            scene.layer.plan(inputs["metadata"])
            check_step(scene, inputs, scene.run(inputs), tolerance=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("formats", [("fp8_ds_mla_v4", None), ("fp8_ds_mla_v41", "fp4_ds_mla_v41")],
                         ids=["584", "528+288"])
def test_decode_step_replays_from_a_cuda_graph(formats):
    """A planned decode step (MTP included) captured once: replayed with new queries and rows (the window
    rows written by the replay), its output is the float64 V4 attention of the new values; an eager call of
    the same step after it agrees."""
    scene = _gpu_scene(formats)
    with torch.inference_mode():
        inputs = scene.step(HISTORY, compressed=8)
        scene.layer.plan(inputs["metadata"])
        scene.run(inputs)
        inputs = scene.step([(0, 1), (1, 2), (2, 1)], decode_threshold=2, compressed=0)
        scene.layer.plan(inputs["metadata"], cuda_graph=True)
        output = torch.full((inputs["q"].shape[0], scene.heads * 512), float("nan"), dtype=torch.bfloat16,
                            device="cuda")
        call = lambda: scene.layer(inputs["q"], inputs["kv"], scene.kv_cache, scene.window_cache,  # noqa: E731
                                   inputs["metadata"], output, topk_indices=inputs["topk_indices"],
                                   topk_length=inputs["topk_length"])
        graph = capture_graph(call)  # its warm call binds every plan and launch before the capture
        for _ in range(2):
            inputs["q"].copy_(scene.randn(*inputs["q"].shape))
            inputs["kv"].copy_(scene.randn(*inputs["kv"].shape))
            output.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            check_step(scene, inputs, output.clone(), tolerance=1e-2)
        replayed = output.clone()
        output.fill_(float("nan"))
        call()
        assert relative_error(output, replayed) < 1e-2
