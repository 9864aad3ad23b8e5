"""What the stand-in aiter models of the real one (v0.1.20.post1, see ../contract.json).

* `get_gfx()` / `get_cu_num()`: the architecture of the platform mla_multi runs
  on (impersonated in tests; gfx942 on a CPU), or FAKE_AITER_GFX.
* `decode_kernel(...)`: which assembly kernel `mla_decode_fwd` reaches for a
  configuration, or the error aiter raises: the Python gate of
  `mla_decode_fwd` (native head counts, the fold of 32..128 heads into groups
  of 16 in persistent mode), the C++ mapping of `mla_decode_stage1_asm_fwd`
  (head count and query length to a kernel-table key, gfx950's folds) and a
  lookup in the kernel table read from contract.json.
* `non_persistent_splits(...)`: the split count `get_meta_param` picks when
  `num_kv_splits` is left to aiter, and `non_persistent_lse_written(...)`:
  whether the non-persistent path writes `final_lse` (its one-split paths
  return the output early or copy it without writing the LSE).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib

import torch

CONTRACT = pathlib.Path(__file__).resolve().parent.parent / "contract.json"
CU_NUM = {"gfx942": 304, "gfx950": 256}
FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


class AiterError(RuntimeError):
    """What aiter's AITER_CHECK / assert raise."""


@functools.lru_cache(maxsize=1)
def contract() -> dict:
    return json.loads(CONTRACT.read_text())


def kernel_table(arch: str) -> list[dict]:
    return contract()["mla_kernels"].get(arch) or []


def get_gfx() -> str:
    forced = os.environ.get("FAKE_AITER_GFX")
    if forced:
        return forced
    from mla_multi.platforms import current_platform

    arch = current_platform().arch
    return arch if arch in CU_NUM else "gfx942"  # a CPU run stands in for an MI300X


def get_cu_num() -> int:
    return CU_NUM.get(get_gfx(), 304)


def type_name(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype in FP8:
        return "fp8"
    if dtype in (torch.uint8, torch.int8):
        return "byte"
    raise AiterError(f"unsupport dtype: {dtype}")


def _native_persistent(arch: str, q: str, kv: str, nhead: int, msq: int) -> bool:
    """mla_decode_fwd's list of head counts its persistent path runs without folding (experimental kernels off)."""
    fp8 = q == "fp8" and kv == "fp8"
    return (
        nhead == 16
        or (arch == "gfx942" and nhead == 128 and fp8)
        or (arch == "gfx950" and fp8 and nhead in (32, 64, 128))
        or (arch == "gfx950" and nhead == 8 and fp8 and msq == 4)
        or (arch == "gfx942" and nhead == 8 and q == "bf16" and kv == "bf16" and msq == 2)
        or (arch == "gfx942" and nhead == 64 and fp8 and msq == 1)
        or (arch == "gfx950" and q == "bf16" and kv == "bf16")
    )


def decode_kernel(arch: str, q: str, kv: str, nhead: int, msq: int, persistent: bool, lse: bool,
                  causal: bool = True) -> tuple[dict, int]:
    """(kernel-table row, the head count the kernel runs: 16 where aiter folds heads) or AiterError."""
    if persistent and not _native_persistent(arch, q, kv, nhead, msq):
        if nhead in range(32, 129, 16):
            nhead = 16
        else:
            raise AiterError(f"nhead={nhead} and max_seqlen_q={msq} not supported")
    gqa = nhead
    ps = 1 if persistent else 0
    key_causal = 1 if msq == 1 else int(causal)
    key_qlen, key_gqa = msq, gqa
    bf16 = q == "bf16" and kv == "bf16"
    fp8 = q == "fp8" and kv == "fp8"
    if gqa == 128:
        key_qlen = 0
        if bf16 and arch == "gfx942":
            ps = 0
    elif gqa == 16:
        if bf16:
            if persistent:
                if msq <= 4:
                    key_qlen = 4
            else:
                key_qlen = 1 if msq == 1 else (4 if msq <= 4 else 8)
        elif q == "bf16" and kv in ("fp8", "byte"):
            if persistent and msq <= 4:
                key_qlen = 4
        elif q == "fp8":
            if msq in (1, 2):
                key_qlen = msq
            elif msq <= 4:
                key_qlen = 4
            elif persistent and arch == "gfx950":
                key_qlen, key_gqa = 4, 32
            else:
                raise AiterError("only support gqa_ratio=16 fp8 mla decoding with qo_len <= 4 and qo_len>4 in "
                                 "persistent mode on gfx950")
    elif gqa == 32:
        if bf16:
            if not persistent:
                key_qlen = 0
        elif fp8:
            if msq == 1 and not persistent:
                key_qlen = 1
            elif msq >= 3 and persistent and arch == "gfx950":
                key_qlen = 4
            elif msq in (1, 2) and persistent:
                key_qlen = msq
            else:
                raise AiterError("fp8/fp8 with gqa_ratio=32 only supports decode_qlen=1,2 in persistent mode and "
                                 "decode_qlen>=3 in persistent mode on gfx950")
    elif gqa == 64:
        if bf16:
            if not persistent:
                key_qlen = 1 if msq == 1 else 0
        elif fp8:
            if persistent:
                key_qlen = 1 if msq == 1 else 4
            else:
                raise AiterError("fp8/fp8 with gqa_ratio=64 only supports persistent mode")
    elif gqa == 8:
        if fp8 and not persistent and msq == 1:
            key_qlen = 1
    if arch == "gfx950" and persistent:
        if bf16 and (gqa * msq >= 128 or gqa > 64) and gqa != 48:
            key_qlen, key_gqa = 4, 32
        elif bf16 and (gqa * msq >= 64 or gqa >= 16):
            key_qlen, key_gqa = 1, 64
        elif fp8 and ((gqa == 32 and msq >= 4) or (gqa == 64 and msq >= 2) or gqa == 128):
            key_qlen, key_gqa = 4, 32
        elif fp8 and ((gqa == 16 and msq in (3, 4)) or (gqa == 32 and msq in (2, 3)) or (gqa == 64 and msq == 1)):
            key_qlen, key_gqa = 4, 16
    lse_flag = 1 if (lse and persistent) else 0
    for row in kernel_table(arch):
        if (row["q"], row["kv"], row["gqa"], row["ps"], row["prefill"], row["causal"], row["qlen"], row["lse"],
                row["cprr"]) == (q, kv, key_gqa, ps, 0, key_causal, key_qlen, lse_flag, 0):
            return row, gqa
    raise AiterError(
        f"get_heuristic_kernel_mla: cannot get heuristic kernel! q_type:{q} kv_type:{kv} gqa:{key_gqa} ps:{ps} "
        f"prefill:0 causal:{key_causal} qseqlen:{key_qlen} lse:{lse_flag} cprr:0 ({arch})"
    )


def persistent_gate(arch: str, bs: int, nhead: int, msq: int, q: str, kv: str) -> bool:
    """mla_decode_fwd keeps the persistent kernel (True) or falls back to the split-KV one at a large batch."""
    profile = arch == "gfx950" and q == "bf16" and kv == "bf16" and nhead == 16 and msq == 1
    if not profile:
        return True
    try:
        limit = int(os.environ.get("AITER_MLA_DECODE_PERSISTENT_MAX_BATCH", 32))
    except ValueError:
        limit = 32
    return limit <= 0 or bs < limit


_FP8_BLOCK_N = {8: 64, 16: 128, 24: 128, 32: 128, 48: 64, 64: 64, 128: 32, 256: 32, 384: 32, 512: 32}


def non_persistent_splits(num_kv_splits, bs: int, total_kv: int, nhead: int, msq: int, q: str) -> int:
    """get_meta_param's split count."""
    if num_kv_splits is None:
        cu = get_cu_num()
        avg = total_kv / bs
        scores = [(bs * i / ((bs * i + cu - 1) // cu * cu) * avg / (avg + 84.1 * i), i) for i in range(1, 17)]
        num_kv_splits = max(scores, key=lambda s: s[0])[1]
    if q == "fp8":
        block = _FP8_BLOCK_N[nhead * msq]
        num_kv_splits = min(num_kv_splits, (total_kv + bs * block - 1) // (bs * block))
        if num_kv_splits > 1:
            num_kv_splits = min(num_kv_splits, int(abs(total_kv / bs - msq) // block) + 1)
    return num_kv_splits


def non_persistent_lse_written(splits: int, nhead: int, msq: int, q: str, kv: str) -> bool:
    """Whether the non-persistent path writes final_lse: not where one split returns the output early
    (stage 1 wrote it) nor where the second stage copies a one-split output."""
    if splits == 1 and (q == "fp8" or (q == "bf16" and msq == 4) or (q == kv == "bf16" and nhead in (32, 8))):
        return False
    copies = not (nhead in (8, 16) and msq == 1)
    return not (copies and splits == 1)
