"""examples/deepseek_v3_transformers.py: transformers' DeepSeek-V3 (small, random weights, YaRN) with its attention
served by MLAAttention over a paged cache, continuous batching with chunked prefills, against transformers itself.

Needs transformers (in the `test` and `examples` extras); skipped with the reason where it is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install -e '.[test]' (or '.[examples]')"
)

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "deepseek_v3_transformers.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("deepseek_v3_transformers", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    try:
        module.tiny_config()
    except Exception as error:  # an installed transformers without the model, or with another config
        pytest.skip(f"transformers {transformers.__version__}: {type(error).__name__}: {str(error)[:200]}")
    return module


def test_cpu_float64_tokens_and_logits_equal_transformers(example):
    """float64, REFERENCE: greedy tokens equal transformers' generate() for every request; the first layer's
    attention output within 1e-12 of transformers' float64 SDPA attention, the logits within 1e-6 (transformers'
    float32 RMSNorm and router); the steps mixed decodes with prefills, chunked prompts, and context."""
    results = example.run("cpu")
    print(json.dumps({k: v for k, v in results.items() if k != "requests"}))
    assert results["backends"] == {"prefill": "REFERENCE", "decode": "REFERENCE"}
    stats = results["stats"]
    assert stats["mixed_steps"] >= 2 and stats["chunked_prefills"] >= 2 and stats["prefills_with_context"] >= 2, stats
    assert results["tokens_equal"], results["requests"]
    assert results["max_rel_attention_err"] <= 1e-12, results["max_rel_attention_err"]
    assert results["max_rel_logit_err"] <= 1e-6, results["max_rel_logit_err"]
    assert results["ok"]
    # the scale carries YaRN's mscale(40, mscale_all_dim=1)^2 = (0.1 ln 40 + 1)^2
    assert results["scale"] == pytest.approx(192**-0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)


def test_served_attention_modules_hold_no_copy_of_kv_b_proj(example):
    model = example.build_model(example.tiny_config(4), torch.float64, "cpu")
    example.PagedAttention(model, num_blocks=8, block_size=16, max_model_len=128, max_num_seqs=2)
    for layer in model.model.layers:
        attn = layer.self_attn
        assert attn.mla.kv_b_proj_weight is attn.kv_b_proj.weight
        assert attn.mla.W_UV.untyped_storage().data_ptr() == attn.kv_b_proj.weight.untyped_storage().data_ptr()
    # one storage per weight in the whole model (named_parameters deduplicates the shared one)
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(storages) == len(set(storages))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gpu_bf16_logits_within_transformers_own_bf16_error(example, kv_cache_dtype):
    """bf16 with the registry's kernels: under teacher forcing, the logits' error against transformers' float32
    model is within 2x transformers' own bf16 model's error and 5e-2 (FP8 cache, scale 0.05: 2e-1), and the
    top-1 agreement with the float32 logits within 5 points of transformers' bf16 model's (FP8: 10); the tokens,
    beside transformers' float32 and bf16 greedy tokens, are printed."""
    results = example.run("cuda", kv_cache_dtype=kv_cache_dtype, num_heads=16)
    print(json.dumps(results))
    if kv_cache_dtype == "auto":
        assert results["ok"], results
        slack = 0.05
    else:
        assert results["rel_logit_err"] <= 0.2, results
        slack = 0.10
    assert results["top1_agreement"] >= results["transformers_bf16_top1_agreement"] - slack, results
