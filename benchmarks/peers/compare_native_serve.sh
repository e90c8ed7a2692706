#!/usr/bin/env bash
# The same serving workloads against chatserve, native llama.cpp `llama-server` and ik_llama.cpp's
# `llama-server` (#57): one server at a time, same GGUF, same threads.
#
#   benchmarks/peers/compare_native_serve.sh                           # the default model, all three servers
#   MODEL=~/.cache/chatserve-native/models/llama-3.2-1b-random-q4_0.gguf benchmarks/peers/compare_native_serve.sh
#   ENGINES="chatserve ik" benchmarks/peers/compare_native_serve.sh
#
# The binaries come from benchmarks/peers/build_native.sh (run it first). Each server starts on
# 127.0.0.1 (free port), is measured, then stopped (compare_common.sh stops it on exit and Ctrl-C too):
#   1. `chatserve bench serve`: NUM_PROMPTS random prompts of INPUT_LEN -> OUTPUT_LEN tokens at
#      MAX_CONCURRENCY (ignore_eos: every output has exactly OUTPUT_LEN tokens; both llama-servers
#      honour ignore_eos), vLLM's result keys;
#   2. a streamed chat workload: benchmarks/serving/bench_serving.py --workload multi-turn (chat
#      completions, SSE; NUM_REQUESTS requests at CONCURRENCY, MAX_TOKENS each, ignore_eos).
# Servers: chatserve (`chatserve serve`, the GGUF's quantized kernels, prefix cache on);
# llama-server with SLOTS parallel slots sharing SLOTS x SLOT_CTX tokens of context, continuous
# batching (its default), THREADS for decode and batch; ik's llama-server the same plus `--run-time-repack` and `-no-fa` (ik 0.1.5's
# flash-attention kernel fails GGML_ASSERT(S > 0) on parallel slots: the server aborts on the first batch).
# Peak RSS (VmHWM) of each server is read before it stops.
#
# Knobs (environment): MODEL (default: the 135M default GGUF), ENGINES ("chatserve llamacpp ik"),
# THREADS (2), NUM_PROMPTS (32), INPUT_LEN (256), OUTPUT_LEN (64), MAX_CONCURRENCY (8),
# NUM_REQUESTS (16), CONCURRENCY (4), MAX_TOKENS (64), SLOTS (8), SLOT_CTX (2048), MAX_MODEL_LEN
# (2048), KV_GB (2), OUT_DIR, MAINLINE_BIN / IK_BIN (folders of the binaries).
set -euo pipefail

# shellcheck source=benchmarks/compare_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../compare_common.sh"
LOG_TAG=compare_native_serve
case "${1:-}" in
    -h|--help) print_header "${BASH_SOURCE[0]}"; exit 0 ;;
    "") ;;
    *) log "unknown argument: $1 (try -h)"; exit 2 ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
PY=${PY:-"$ROOT/.venv/bin/python"}
ENGINES=${ENGINES:-"chatserve llamacpp ik"}
THREADS=${THREADS:-2}
NUM_PROMPTS=${NUM_PROMPTS:-32}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-64}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-8}
NUM_REQUESTS=${NUM_REQUESTS:-16}
CONCURRENCY=${CONCURRENCY:-4}
MAX_TOKENS=${MAX_TOKENS:-64}
SLOTS=${SLOTS:-8}
SLOT_CTX=${SLOT_CTX:-2048}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048}
KV_GB=${KV_GB:-2}
OUT_DIR=${OUT_DIR:-"$ROOT/bench_results/compare-native-serve-$(date -u +%Y%m%d-%H%M%S)"}
MAINLINE_BIN=${MAINLINE_BIN:-$(bash benchmarks/peers/build_native.sh --print-dir mainline)}
IK_BIN=${IK_BIN:-$(bash benchmarks/peers/build_native.sh --print-dir ik)}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

[ -x "$PY" ] || { log "no .venv: run scripts/setup_env.sh first"; exit 2; }
for e in $ENGINES; do
    case $e in
        chatserve) ;;
        llamacpp) [ -x "$MAINLINE_BIN/llama-server" ] || { log "no $MAINLINE_BIN/llama-server: run benchmarks/peers/build_native.sh"; exit 2; } ;;
        ik) [ -x "$IK_BIN/llama-server" ] || { log "no $IK_BIN/llama-server: run benchmarks/peers/build_native.sh"; exit 2; } ;;
        *) log "unknown engine: $e (chatserve, llamacpp or ik)"; exit 2 ;;
    esac
done
MODEL=${MODEL:-$("$PY" -c 'from chatserve.models.loader import default_model_path; print(default_model_path())')}
MODEL=$(realpath "$MODEL")
NAME=$(basename "$MODEL" .gguf)
mkdir -p "$OUT_DIR"
install_cleanup

start_engine() {  # engine port
    local ctx=$((SLOTS * SLOT_CTX))
    case $1 in
        chatserve)
            start_server chatserve "$OUT_DIR/chatserve.log" "$PY" -m chatserve serve "$MODEL" --host 127.0.0.1 --port "$2" \
                --num-threads "$THREADS" --max-model-len "$MAX_MODEL_LEN" --served-model-name "$NAME" \
                --kv-cache-memory-gb "$KV_GB" --log-level warning ;;
        llamacpp)
            start_server llamacpp "$OUT_DIR/llamacpp.log" "$MAINLINE_BIN/llama-server" -m "$MODEL" --alias "$NAME" \
                --host 127.0.0.1 --port "$2" -t "$THREADS" -tb "$THREADS" -c "$ctx" -np "$SLOTS" ;;
        ik)
            start_server ik "$OUT_DIR/ik.log" "$IK_BIN/llama-server" -m "$MODEL" --alias "$NAME" \
                --host 127.0.0.1 --port "$2" -t "$THREADS" -tb "$THREADS" -c "$ctx" -np "$SLOTS" --run-time-repack -no-fa ;;
    esac
}

for ENGINE in $ENGINES; do
    PORT=$(free_port)
    start_engine "$ENGINE" "$PORT"
    wait_ready "$ENGINE" "http://127.0.0.1:$PORT/v1/models" "$OUT_DIR/$ENGINE.log" 900
    log "$ENGINE up on port $PORT"
    URL="http://127.0.0.1:$PORT"
    run_child "$PY" -m chatserve bench serve --base-url "$URL" --backend openai --model "$NAME" --dataset-name random \
        --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" \
        --max-concurrency "$MAX_CONCURRENCY" --ignore-eos --seed 0 --num-warmups 2 --save-result \
        --result-dir "$OUT_DIR" --result-filename "serve-$ENGINE.json" --label "$ENGINE" --disable-tqdm ||
        log "bench serve against $ENGINE failed"
    run_child "$PY" benchmarks/serving/bench_serving.py --base-url "$URL" --workload multi-turn --endpoint chat \
        --num-requests "$NUM_REQUESTS" --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" --ignore-eos --seed 0 \
        --label "$ENGINE" --json "$OUT_DIR/chat-$ENGINE.json" || log "streamed chat against $ENGINE: some requests failed"
    echo "$(tree_mem_kb "${SERVER_PIDS[$ENGINE]}" VmHWM)" >"$OUT_DIR/rss-$ENGINE.kb"
    stop_server "$ENGINE"
done

{
    echo "# $NAME: bench serve $NUM_PROMPTS random prompts $INPUT_LEN -> $OUTPUT_LEN at concurrency $MAX_CONCURRENCY;" \
        "streamed chat (multi-turn) $NUM_REQUESTS requests at $CONCURRENCY, $MAX_TOKENS tokens;" \
        "$(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, $THREADS threads, load $(cut -d' ' -f1-3 /proc/loadavg)"
    "$PY" - "$OUT_DIR" "$ENGINES" <<'EOF'
import json, os, sys
out, engines = sys.argv[1], sys.argv[2].split()
label = {"chatserve": "chatserve", "llamacpp": "llama.cpp llama-server", "ik": "ik_llama.cpp llama-server"}
keys = ["completed", "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_itl_ms"]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else {}
serve = {e: load(f"serve-{e}.json") for e in engines}
rows = [["chatserve bench serve"] + [label[e] for e in engines]]
rows += [[k] + ["-" if serve[e].get(k) is None else f"{serve[e][k]:,.2f}" for e in engines] for k in keys]
rss = {}
for e in engines:
    path = os.path.join(out, f"rss-{e}.kb")
    rss[e] = f"{int(open(path).read().strip() or 0) / 1024:,.0f}" if os.path.exists(path) else "-"
rows.append(["server peak RSS MiB"] + [rss[e] for e in engines])
widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
for i, r in enumerate(rows):
    print("| " + " | ".join(x.ljust(w) for x, w in zip(r, widths)) + " |")
    if i == 0:
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
EOF
    echo
    echo "## streamed chat (multi-turn)"
    chats=()
    for e in $ENGINES; do [ -f "$OUT_DIR/chat-$e.json" ] && chats+=("$OUT_DIR/chat-$e.json"); done
    [ "${#chats[@]}" -gt 0 ] && "$PY" benchmarks/serving/bench_serving.py --side-by-side "${chats[@]}"
} | tee "$OUT_DIR/summary.md"
log "results in $OUT_DIR"
