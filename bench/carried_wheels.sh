# Sourced by bench/gpu_suite.sh: the common environment, and FlashMLA installed from a carried wheel
# (.whl/sgl_flash_mla-*.whl, --no-deps: it runs on the device's torch) onto PYTHONPATH when one is there.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
if ls .whl/sgl_flash_mla-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/sgl_flash_mla-*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
# transformers (examples/deepseek_v3_transformers.py, tests/test_examples_transformers.py) from a carried wheel,
# its dependencies the device's own: pip download --no-deps 'transformers>=5.24,<6' -d .whl/transformers
# --only-binary=:all: --python-version <the device's>
if ls .whl/transformers/transformers-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_transformers \
    .whl/transformers/transformers-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site_transformers
fi
