export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 130 python3 -m pytest -q -m gpu tests/test_kernels_prefill.py tests/test_kernels_prefill_wgmma.py tests/test_attention.py tests/test_ops.py -p no:cacheprovider 2>&1 | tail -4
timeout 60 python3 -m mla_multi bench layer --heads 128 --steps prefill:1x8192,prefill:16x512+3584 --decode-backends TRITON --prefill-backends TRITON 2>&1 | grep "^|"
