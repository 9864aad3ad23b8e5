"""One shape of the sm_90 prefill kernel (and, named after it, cuDNN's SDPA or FlashInfer's fa3 ragged prefill on
the same inputs) called three times each, for Nsight Compute to profile the third call:

    ncu --clock-control none -k regex:prefill_wgmma -s 2 -c 1 --section SpeedOfLight \\
        python3 bench/ncu_prefill.py 16,512,128      # B,S,N; causal, qk 192 / v 128, bf16
    ncu --clock-control none -k regex:'(?i)prefill' --metrics sm__cycles_elapsed.max,dram__bytes_read.sum \\
        python3 bench/ncu_prefill.py 1,8192,128 flashinfer     # or: cudnn
"""
import sys

import torch

from mla_multi.kernels.prefill_wgmma import varlen_attention_wgmma

torch.manual_seed(0)
batch, seqlen, heads = (int(x) for x in sys.argv[1].split(","))
tokens = batch * seqlen
q = torch.randn(tokens, heads, 192, device="cuda", dtype=torch.bfloat16)
k = torch.randn(tokens, heads, 192, device="cuda", dtype=torch.bfloat16)
v = torch.randn(tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
cu = torch.arange(0, tokens + 1, seqlen, device="cuda", dtype=torch.int32)
out = torch.empty(tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
lse = torch.empty(heads, tokens, device="cuda", dtype=torch.float32)
for _ in range(3):
    varlen_attention_wgmma(q, k, v, cu, cu, seqlen, seqlen, 192**-0.5, causal=True, out=out, lse=lse)
torch.cuda.synchronize()
peers = sys.argv[2:]
unknown = set(peers) - {"flashinfer", "cudnn"}
if unknown:
    sys.exit(f"peers {sorted(unknown)}; accepted: flashinfer, cudnn")
if "flashinfer" in peers:
    from mla_multi.benchmarks.prefill import _flashinfer_prefill

    run, reason = _flashinfer_prefill(q, k, v, cu, seqlen, 192**-0.5, True)
    if run is None:
        sys.exit(f"flashinfer: {reason}")
    for _ in range(3):
        run()
    torch.cuda.synchronize()
if "cudnn" in peers:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4, k4 = (t.view(batch, seqlen, heads, 192).transpose(1, 2) for t in (q, k))
    v4 = v.view(batch, seqlen, heads, 128).transpose(1, 2)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(3):
            torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=192**-0.5)
    torch.cuda.synchronize()
