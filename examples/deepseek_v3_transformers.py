"""Hugging Face transformers' DeepSeek-V3 with its attention served by `mla_multi.MLAAttention` over a paged cache.

A small random-weight `DeepseekV3ForCausalLM` (2 layers, hidden 256, DeepSeek-V3's attention dims with fewer
heads, q_lora_rank set, YaRN rope scaling as DeepSeek-V3's config.json writes it, one MoE layer) serves several
prompts by continuous batching: each step's tokens (decodes and prefill chunks of several requests, in arrival
order) go through the model as one [1, T] batch; every `DeepseekV3Attention` runs its own projections, norms
and RoPE, and hands q, kv_c and k_pe to an `MLAAttention` (its kv_b_proj.weight shared, not copied) with the
step's metadata (`from_lengths(..., reorder=True)`: the layer takes the tokens in arrival order). Greedy tokens
are compared with transformers' own `generate()` and every step's logits with transformers' forward over the
same tokens (teacher forcing).

    python examples/deepseek_v3_transformers.py                  # CPU: float64, the REFERENCE backend
    python examples/deepseek_v3_transformers.py --device cuda    # GPU: bf16, the registry's kernels

On the CPU (float64) the first layer's attention output (o_proj's input, whose inputs are the same bits in both
runs) must match transformers' float64 SDPA attention within 1e-12 (relative, per token), the logits within 1e-6
(transformers' RMSNorm and MoE router compute in float32 inside a float64 model, so the attention's float64
rounding reaches the logits at float32's: about 5e-8), and the tokens must be equal. On the GPU (bf16) the logits are compared with transformers' float32 model: the error
must be within 2x transformers' own bf16 model's error against the same float32 logits (and under 5e-2); the
tokens are reported beside transformers' float32 and bf16 greedy tokens. `--check` exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import sys
import time
import types

import torch

import mla_multi as mm

# DeepSeek-V3's config.json, "rope_scaling"
DEEPSEEK_V3_ROPE_SCALING = {
    "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096, "type": "yarn",
}
CPU_TOLERANCE = 1e-6  # float64: largest relative logit error of a token against transformers' float64 SDPA
CPU_ATTENTION_TOLERANCE = 1e-12  # float64: the same for the first layer's attention output
GPU_RELATIVE_TO_TRANSFORMERS_BF16 = 2.0  # bf16: at most this many times transformers' own bf16 error
GPU_TOLERANCE = 5e-2  # and at most this, relative to the float32 logits


def tiny_config(num_heads: int = 8, num_layers: int = 2):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
        q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=163840, rope_scaling=dict(DEEPSEEK_V3_ROPE_SCALING), rope_theta=10000.0,
        initializer_range=0.1,  # sharper attention than the default 0.02 (scores of a few units, not ~0.2)
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )


def build_model(config, dtype: torch.dtype, device: str, seed: int = 0):
    """The random-weight model (the same weights for a seed), with transformers' SDPA attention as its own."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    # "eager" experts: the grouped-matmul experts take no float64; SDPA: an attention computed in the model's
    # dtype (the eager one takes its softmax in float32)
    try:
        model = DeepseekV3ForCausalLM._from_config(config, attn_implementation="sdpa", experts_implementation="eager")
    except TypeError:  # a transformers without the experts' implementations: its experts are plain matmuls
        model = DeepseekV3ForCausalLM._from_config(config, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval()


# --------------------------------------------------------------------------- the attention, served by mla_multi


@dataclasses.dataclass
class Step:
    metadata: mm.CommonAttentionMetadata
    caches: list


class PagedAttention:
    """Serves every `DeepseekV3Attention` of `model` through an `MLAAttention` over a paged latent cache while a
    step is set (`with server.step(metadata): model(...)`); transformers' own attention otherwise.

    Each attention module gets `mla` (an `MLAAttention`, a submodule holding the module's own kv_b_proj.weight
    parameter: no copy) and a forward that computes q, kv_c (after kv_a_layernorm) and k_pe with the module's
    projections and RoPE exactly as transformers does, passes q as transformers lays it out ([1, N, T, P + R],
    viewed as [T, N, P + R]), and applies o_proj to the result."""

    def __init__(self, model, *, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 kv_cache_dtype="auto", kv_cache_scale=None, workspace_tokens=None) -> None:
        self.current: Step | None = None
        self.block_size = block_size
        self.caches = []
        for layer in model.model.layers:
            attn = layer.self_attn
            dims = mm.MLADims(attn.num_heads, attn.kv_lora_rank, attn.qk_nope_head_dim, attn.qk_rope_head_dim,
                              attn.v_head_dim)
            # the softmax scale transformers uses: 1/sqrt(P + R) times YaRN's mscale(factor, mscale_all_dim)^2
            attn.mla = mm.MLAAttention(dims, attn.scaling, attn.kv_b_proj.weight, block_size=block_size,
                                       max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                       kv_cache_dtype=kv_cache_dtype, kv_cache_scale=kv_cache_scale,
                                       workspace_tokens=workspace_tokens)
            attn.forward = types.MethodType(functools.partial(_paged_forward, server=self, original=attn.forward), attn)
            self.caches.append(attn.mla.allocate_kv_cache(num_blocks))
        self.layers = [layer.self_attn.mla for layer in model.model.layers]

    def step(self, metadata: mm.CommonAttentionMetadata):
        server = self

        class _Serving:
            def __enter__(self):
                server.current = Step(metadata, server.caches)
                return server.current

            def __exit__(self, *exc):
                server.current = None

        return _Serving()


def _paged_forward(self, hidden_states, *args, server: PagedAttention, original, **kwargs):
    """`DeepseekV3Attention.forward` with the attention by mla_multi (transformers' own where no step is set)."""
    step = server.current
    if step is None:
        return original(hidden_states, *args, **kwargs)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    position_embeddings = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[0]
    batch, length = hidden_states.shape[:-1]  # [1, T]: the step's tokens side by side
    if self.q_lora_rank is None:
        q_states = self.q_proj(hidden_states)
    else:
        q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q_states = q_states.view(batch, length, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim],
                                 dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope)  # kv_c: the latent after the layernorm
    k_rot = k_rot.view(batch, 1, length, self.qk_rope_head_dim)
    cos, sin = position_embeddings
    rotate = apply_rotary_pos_emb_interleave if self.config.rope_interleave else apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)  # RoPE (the caller's), on q's rotary part and k_pe
    query = torch.cat((q_pass, q_rot), dim=-1)  # [1, N, T, P + R]: non-rotary part first
    out = self.mla(query[0].transpose(0, 1), kv_nope[0], k_rot[0, 0], step.caches[self.layer_idx], step.metadata)
    return self.o_proj(out.view(batch, length, -1)), None


# --------------------------------------------------------------------------- continuous batching


@dataclasses.dataclass
class Request:
    rid: int
    prompt: list
    max_new_tokens: int
    arrival: int  # the step it arrives at
    tokens: list = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens in the cache
    blocks: list = dataclasses.field(default_factory=list)
    logits: dict = dataclasses.field(default_factory=dict)  # position -> the logits after that token
    attention: dict = dataclasses.field(default_factory=dict)  # position -> the first layer's attention output

    @property
    def generated(self) -> list:
        return self.tokens[len(self.prompt):]

    @property
    def finished(self) -> bool:
        return len(self.generated) >= self.max_new_tokens


def serve(model, server: PagedAttention, requests: list, token_budget: int, num_blocks: int, device) -> dict:
    """Greedy generation of every request by continuous batching: each step, the running decodes (one token each)
    and then prefill chunks of the arrived prompts up to `token_budget` tokens, the batch in arrival order."""
    free = list(range(num_blocks))
    for request in requests:
        request.tokens = list(request.prompt)
    stats = {"steps": 0, "mixed_steps": 0, "chunked_prefills": 0, "prefills_with_context": 0, "max_tokens": 0}
    step = 0
    while not all(r.finished for r in requests):
        running = [r for r in requests if r.arrival <= step and not r.finished]
        budget = token_budget
        counts = {}
        for r in running:  # decodes first in the budget (never starved), the batch stays in arrival order
            if r.computed >= len(r.prompt):
                counts[r.rid] = 1
                budget -= 1
        for r in running:
            if r.computed < len(r.prompt) and budget > 0:
                counts[r.rid] = min(len(r.prompt) - r.computed, budget)
                budget -= counts[r.rid]
        batch = [r for r in running if counts.get(r.rid)]
        step += 1
        if not batch:
            continue
        ids, positions, query_lens, seq_lens = [], [], [], []
        for r in batch:
            n = counts[r.rid]
            ids += r.tokens[r.computed:r.computed + n]
            positions += range(r.computed, r.computed + n)
            query_lens.append(n)
            seq_lens.append(r.computed + n)
            while len(r.blocks) * server.block_size < r.computed + n:
                r.blocks.append(free.pop(0))
            if r.computed < len(r.prompt) and n < len(r.prompt) - r.computed:
                stats["chunked_prefills"] += 1
            if r.computed and n > 1:
                stats["prefills_with_context"] += 1
        width = max(len(r.blocks) for r in batch)
        table = torch.zeros(len(batch), width, dtype=torch.int32)
        for row, r in enumerate(batch):
            table[row, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        # the batch in arrival order (decodes and prefills mixed): the metadata runs it decodes first and the
        # layers take and return the tokens in this order
        metadata = mm.CommonAttentionMetadata.from_lengths(query_lens, seq_lens, table.to(device), server.block_size,
                                                           reorder=True)
        stats["steps"] += 1
        stats["mixed_steps"] += int(1 in query_lens and max(query_lens) > 1)
        stats["max_tokens"] = max(stats["max_tokens"], len(ids))
        with server.step(metadata), torch.inference_mode(), FirstAttention(model) as attention:
            logits = model(input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([positions], device=device),
                           use_cache=False).logits[0]
        logits = logits if logits.dtype == torch.float64 else logits.float()
        offset = 0
        for r in batch:
            n = counts[r.rid]
            for i in range(n):
                r.logits[r.computed + i] = logits[offset + i]
                r.attention[r.computed + i] = attention.output[offset + i]
            r.computed += n
            offset += n
            if r.computed == len(r.tokens):  # the whole prompt (or the last token) is in: the next token
                r.tokens.append(int(logits[offset - 1].argmax()))
            if r.finished:
                free += r.blocks
                r.blocks = []
    return stats


class FirstAttention:
    """Records the first layer's attention output (o_proj's input, [T, N * V]) of the forward run inside it."""

    def __init__(self, model) -> None:
        self.module = model.model.layers[0].self_attn.o_proj
        self.output = None

    def __enter__(self):
        self.handle = self.module.register_forward_pre_hook(self._record)
        return self

    def _record(self, module, args):
        self.output = args[0][0].detach()

    def __exit__(self, *exc):
        self.handle.remove()


def teacher_forced(model, tokens: list, device) -> tuple:
    """transformers' own forward (its SDPA attention) over `tokens` at once: logits [len, vocab] in float32 (or
    float64) and the first layer's attention output."""
    with torch.inference_mode(), FirstAttention(model) as attention:
        logits = model(input_ids=torch.tensor([tokens], device=device), use_cache=False).logits[0]
    return (logits if logits.dtype == torch.float64 else logits.float()), attention.output


def greedy(model, prompt: list, max_new_tokens: int, device) -> list:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def make_requests(vocab: int, lengths: list, max_new_tokens: int, seed: int = 1) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [Request(rid=i, prompt=torch.randint(0, vocab, (n,), generator=generator).tolist(),
                    max_new_tokens=max_new_tokens, arrival=2 * i) for i, n in enumerate(lengths)]


def relative_rows(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row ||out - ref|| / ||ref||, in float64."""
    out, ref = out.double(), ref.double()
    return (out - ref).norm(dim=-1) / ref.norm(dim=-1)


def run(device: str = "cpu", dtype: torch.dtype | None = None, num_heads: int = 8, kv_cache_dtype: str = "auto",
        prompt_lengths: list | None = None, max_new_tokens: int | None = None, token_budget: int | None = None,
        block_size: int | None = None, workspace_tokens: int | None = None) -> dict:
    """The example; returns its figures (see the module docstring for what is compared)."""
    start = time.perf_counter()
    cuda = device.startswith("cuda")
    dtype = dtype or (torch.bfloat16 if cuda else torch.float64)
    prompt_lengths = prompt_lengths or ([300, 40, 700, 9, 150] if cuda else [9, 70, 5, 23])
    max_new_tokens = max_new_tokens or (16 if cuda else 8)
    token_budget = token_budget or (256 if cuda else 24)  # the longest prompts are prefilled in chunks
    block_size = block_size or (64 if cuda else 16)
    workspace_tokens = workspace_tokens or (None if cuda else 32)  # CPU: the context in chunks of 32 tokens
    config = tiny_config(num_heads)
    reference_dtype = torch.float32 if cuda else dtype
    # transformers' model in the reference dtype, and the same weights in the served dtype
    reference = build_model(config, reference_dtype, device)
    model = copy.deepcopy(reference).to(dtype) if dtype != reference_dtype else reference
    max_len = max(prompt_lengths) + max_new_tokens
    num_blocks = len(prompt_lengths) * -(-max_len // block_size) + 1
    server = PagedAttention(model, num_blocks=num_blocks, block_size=block_size, max_model_len=max_len,
                            max_num_seqs=len(prompt_lengths), kv_cache_dtype=kv_cache_dtype,
                            kv_cache_scale=0.05 if kv_cache_dtype != "auto" else None,
                            workspace_tokens=workspace_tokens)
    requests = make_requests(config.vocab_size, prompt_lengths, max_new_tokens)
    stats = serve(model, server, requests, token_budget, num_blocks, device)
    served_time = time.perf_counter() - start
    results = {
        "device": device, "dtype": str(dtype).replace("torch.", ""), "num_heads": num_heads,
        "kv_cache_dtype": kv_cache_dtype, "backends": server.layers[0].backends(), "stats": stats,
        "scale": server.layers[0].scale, "requests": [],
    }
    worst = worst_attention = 0.0
    ours_all, ref_all, bf16_all = [], [], []
    top1 = []
    bf16_model = copy.deepcopy(reference).to(dtype) if cuda else None
    for r in requests:
        fed = r.tokens[:r.computed]  # every token the model was given
        ours = torch.stack([r.logits[p] for p in range(r.computed)]).to(device)
        ref, ref_attention = teacher_forced(reference, fed, device)
        errors = relative_rows(ours, ref)
        worst = max(worst, float(errors.max()))
        attention = torch.stack([r.attention[p] for p in range(r.computed)])
        worst_attention = max(worst_attention, float(relative_rows(attention, ref_attention).max()))
        ours_all.append(ours.double())
        ref_all.append(ref.double())
        top1.append((ours.argmax(-1) == ref.argmax(-1)).double())
        entry = {"rid": r.rid, "prompt_len": len(r.prompt), "tokens": r.generated,
                 "transformers_tokens": greedy(reference, r.prompt, r.max_new_tokens, device),
                 "max_rel_logit_err": float(errors.max())}
        if cuda:
            bf16_all.append(teacher_forced(bf16_model, fed, device)[0].double())
            entry["transformers_bf16_tokens"] = greedy(bf16_model, r.prompt, r.max_new_tokens, device)
        results["requests"].append(entry)
    ours_cat, ref_cat = torch.cat(ours_all), torch.cat(ref_all)
    results["max_rel_logit_err"] = worst
    results["max_rel_attention_err"] = worst_attention
    results["rel_logit_err"] = float((ours_cat - ref_cat).norm() / ref_cat.norm())
    results["top1_agreement"] = float(torch.cat(top1).mean())
    results["tokens_equal"] = all(e["tokens"] == e["transformers_tokens"] for e in results["requests"])
    if cuda:
        bf16_cat = torch.cat(bf16_all)
        results["transformers_bf16_rel_logit_err"] = float((bf16_cat - ref_cat).norm() / ref_cat.norm())
        results["transformers_bf16_top1_agreement"] = float((bf16_cat.argmax(-1) == ref_cat.argmax(-1)).double().mean())
        results["tolerance"] = min(GPU_TOLERANCE, GPU_RELATIVE_TO_TRANSFORMERS_BF16 * results["transformers_bf16_rel_logit_err"])
        results["ok"] = results["rel_logit_err"] <= results["tolerance"]
    else:
        results["tolerance"] = CPU_TOLERANCE
        results["attention_tolerance"] = CPU_ATTENTION_TOLERANCE
        results["ok"] = (worst <= CPU_TOLERANCE and worst_attention <= CPU_ATTENTION_TOLERANCE
                         and results["tokens_equal"])
    results["served_s"] = served_time
    results["total_s"] = time.perf_counter() - start
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (float64, REFERENCE) or cuda (bf16, the registry's kernels)")
    parser.add_argument("--dtype", default=None, choices=["float64", "float32", "bfloat16", "float16"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8 (scale 0.05)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the tolerances hold")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    results = run(args.device, dtype, args.heads, args.kv_cache_dtype)
    print(f"backends {results['backends']}, {results['dtype']}, {results['num_heads']} heads, "
          f"kv cache {results['kv_cache_dtype']}, scale {results['scale']:.6f} (YaRN mscale^2 included)")
    print(f"steps {results['stats']}")
    for entry in results["requests"]:
        line = (f"request {entry['rid']} (prompt {entry['prompt_len']:4d}): tokens {entry['tokens']}  "
                f"transformers {entry['transformers_tokens']}  max rel logit err {entry['max_rel_logit_err']:.2e}")
        if "transformers_bf16_tokens" in entry:
            line += f"  transformers bf16 {entry['transformers_bf16_tokens']}"
        print(line)
    print(f"logits against transformers' {'float32' if results['device'].startswith('cuda') else results['dtype']}: "
          f"relative error {results['rel_logit_err']:.3e} (largest token {results['max_rel_logit_err']:.3e}), "
          f"top-1 agreement {results['top1_agreement']:.3f}; first layer's attention output: largest token "
          f"{results['max_rel_attention_err']:.3e}")
    if "transformers_bf16_rel_logit_err" in results:
        print(f"transformers' own bf16 model against its float32: relative error "
              f"{results['transformers_bf16_rel_logit_err']:.3e}, top-1 agreement "
              f"{results['transformers_bf16_top1_agreement']:.3f}")
    print(f"greedy tokens equal to transformers' generate(): {results['tokens_equal']}; tolerance "
          f"{results['tolerance']:.2e}: {'ok' if results['ok'] else 'FAILED'}; {results['total_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0 if results["ok"] or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
