#!/usr/bin/env bash
# chatserve serving with quantized weights vs the de-quantised bf16 path (issue #21), in one run.
#
#   benchmarks/serving/compare_quantized_serving.sh              # default model, --quantization auto vs none
#   MODEL=bench_results/SmolLM2-135M-Instruct.Q8_0.gguf benchmarks/serving/compare_quantized_serving.sh
#   MODEL=bench_results/SmolLM2-135M-Instruct-bf16 QUANTS="int8 none" benchmarks/serving/compare_quantized_serving.sh
#
# 1. For each QUANTS value (default "auto none"; the first is the quantized one), ONE AFTER ANOTHER
#    (so the two servers never share the cores): starts `chatserve serve --quantization Q
#    --num-threads THREADS` on a free 127.0.0.1 port, waits for /health, notes its RSS, then runs
#    benchmarks/serving/bench_serving.py at each concurrency of CONCURRENCIES (default "1 4 16") against it,
#    then stops it.
# 2. The workload (same seed, so the same prompts, for every server): WORKLOAD (default random:
#    prompts of RANDOM_MIN..RANDOM_MAX tokens, outputs uniform in MAX_TOKENS/8..MAX_TOKENS with
#    ignore_eos, so every server generates the same token counts), streamed, NUM_REQUESTS per
#    concurrency (default: 2 x concurrency, at least 8: 8, 8 and 32 requests), one warm-up request.
# 3. Prints one table: per concurrency TTFT p50/p90, ITL p50/p90, output tok/s, each server a
#    column, and the ratio first vs second (>1 = the quantized server better); then each server's
#    RSS after start-up and peak (VmHWM). Writes the JSONs and summary.md under OUT_DIR.
#    Every server started is stopped on exit, Ctrl-C and errors (trap, compare_common.sh).
#
# Knobs (environment): MODEL, QUANTS, CONCURRENCIES, NUM_REQUESTS, MAX_TOKENS, WORKLOAD,
# RANDOM_MIN, RANDOM_MAX, THREADS, OUT_DIR, CHATSERVE_ARGS (extra `chatserve serve` flags),
# BENCH_ARGS (extra bench_serving.py flags).
set -euo pipefail

# shellcheck source=benchmarks/compare_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../compare_common.sh"
LOG_TAG=compare_quantized_serving
case "${1:-}" in
    -h|--help) print_header "${BASH_SOURCE[0]}"; exit 0 ;;
    "") ;;
    *) log "unknown argument: $1 (try -h)"; exit 2 ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
PY="$ROOT/.venv/bin/python"
QUANTS=${QUANTS:-"auto none"}
CONCURRENCIES=${CONCURRENCIES:-"1 4 16"}
NUM_REQUESTS=${NUM_REQUESTS:-}
MAX_TOKENS=${MAX_TOKENS:-64}
WORKLOAD=${WORKLOAD:-random}
RANDOM_MIN=${RANDOM_MIN:-32}
RANDOM_MAX=${RANDOM_MAX:-512}
THREADS=${THREADS:-2}
OUT_DIR=${OUT_DIR:-"$ROOT/bench_results/quantized-serving-$(date +%Y%m%d-%H%M%S)"}
CHATSERVE_ARGS=${CHATSERVE_ARGS:-}
BENCH_ARGS=${BENCH_ARGS:-}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

[ -x "$PY" ] || { log "no .venv: run scripts/setup_env.sh first"; exit 2; }
MODEL=${MODEL:-$("$PY" -c 'from chatserve.models.loader import default_model_path; print(default_model_path())')}
[ -e "$MODEL" ] || { log "model not found: $MODEL"; exit 2; }
MODEL=$(cd "$(dirname "$MODEL")" && echo "$PWD/$(basename "$MODEL")")
mkdir -p "$OUT_DIR"
install_cleanup

requests_for() {  # concurrency -> number of requests
    if [ -n "$NUM_REQUESTS" ]; then echo "$NUM_REQUESTS"; else local n=$(( 2 * $1 )); echo $(( n < 8 ? 8 : n )); fi
}

JSONS=()
MEM_LINES=()
START=$(date +%s)
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
for Q in $QUANTS; do
    PORT=$(free_port)
    NAME="chatserve-$Q"
    log "starting chatserve --quantization $Q on 127.0.0.1:$PORT ($THREADS threads, $(basename "$MODEL"))"
    # shellcheck disable=SC2086
    start_server "$NAME" "$OUT_DIR/$NAME.log" \
        "$PY" -m chatserve serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --num-threads "$THREADS" \
        --quantization "$Q" --log-level warning $CHATSERVE_ARGS
    wait_ready "$NAME" "http://127.0.0.1:$PORT/health" "$OUT_DIR/$NAME.log"
    PID=${SERVER_PIDS[$NAME]}
    RSS_START=$(tree_mem_kb "$PID" VmRSS)
    for C in $CONCURRENCIES; do
        N=$(requests_for "$C")
        log "$NAME: concurrency $C, $N requests"
        # shellcheck disable=SC2086
        run_child "$PY" benchmarks/serving/bench_serving.py --base-url "http://127.0.0.1:$PORT" --workload "$WORKLOAD" \
            --num-requests "$N" --concurrency "$C" --max-tokens "$MAX_TOKENS" --random-input-min "$RANDOM_MIN" \
            --random-input-max "$RANDOM_MAX" --seed 0 --label "chatserve ($Q)" --no-progress \
            --json "$OUT_DIR/$Q-c$C.json" $BENCH_ARGS >"$OUT_DIR/$Q-c$C.txt" \
            || log "$NAME concurrency $C: some requests failed (see $OUT_DIR/$Q-c$C.txt and the table)"
        [ -f "$OUT_DIR/$Q-c$C.json" ] && JSONS+=("$OUT_DIR/$Q-c$C.json")
    done
    RSS_PEAK=$(tree_mem_kb "$PID" VmHWM)
    MEM_LINES+=("| chatserve ($Q) | $((RSS_START / 1024)) | $((RSS_PEAK / 1024)) |")
    stop_server "$NAME"
done

[ "${#JSONS[@]}" -gt 0 ] || { log "no benchmark produced results"; exit 1; }
{
    echo "# chatserve serving, --quantization $(echo "$QUANTS" | sed 's/ / vs /g') — $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, $THREADS threads"
    echo "# model: $(basename "$MODEL"); workload $WORKLOAD (prompts $RANDOM_MIN-$RANDOM_MAX tokens, max_tokens $MAX_TOKENS, ignore_eos), seed 0; servers one after another; load average at the start $LOAD_START (keep it near 0: timings on a busy machine mean little)"
    echo
    "$PY" benchmarks/serving/bench_serving.py --grid "${JSONS[@]}"
    echo
    echo "| server | RSS after start-up (MiB) | peak RSS (MiB) |"
    echo "|---|---|---|"
    printf '%s\n' "${MEM_LINES[@]}"
    echo
    echo "total time: $(( $(date +%s) - START )) s"
} | tee "$OUT_DIR/summary.md"
log "summary: $OUT_DIR/summary.md"
