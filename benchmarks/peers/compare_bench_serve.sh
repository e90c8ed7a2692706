#!/usr/bin/env bash
# `chatserve bench serve` against chatserve and against vLLM's CPU build, with the same arguments;
# and, where vLLM is installed, vLLM's own `vllm bench serve` against both with its matching flags.
#
#   benchmarks/peers/compare_bench_serve.sh            # both servers, one at a time; both clients; a table
#   CLIENTS=chatserve benchmarks/peers/compare_bench_serve.sh    # only our client
#
# Why: `chatserve bench serve` takes `vllm bench serve`'s flags and writes its result keys
# (request_throughput, output_throughput, mean/median/p99 ttft/tpot/itl_ms, ...), so one table can
# hold a number from either tool against either server. Running both clients against both servers
# shows the two tools measure the same thing (they differ in how prompts are made: vLLM's random
# dataset draws token ids through the tokenizer, ours draws words and counts them with the
# server's /tokenize; both send ignore_eos, so outputs are exactly --random-output-len tokens).
#
# Servers: the same weights for both (the default GGUF, de-quantised to bf16 by chatserve with
# --quantization none; the bf16 folder converted from it for vLLM, as compare_vllm.sh does, which
# installs .venv-vllm the first time), prefix caching on, THREADS threads, ONE AT A TIME on
# 127.0.0.1 (both at once would share the cores), stopped on exit (compare_common.sh).
#
# Knobs (environment): THREADS (2), NUM_PROMPTS (32), INPUT_LEN (256), OUTPUT_LEN (64),
# MAX_CONCURRENCY (8), REQUEST_RATE (inf), ENGINES ("chatserve vllm"), CLIENTS ("chatserve vllm"),
# OUT_DIR, MAX_MODEL_LEN (2048), KV_GB (2), STARTUP_TIMEOUT (1200 s: vLLM compiles its graphs at its
# first start), HF_DIR (the bf16 folder).
set -euo pipefail

# shellcheck source=benchmarks/compare_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../compare_common.sh"
LOG_TAG=compare_bench_serve
case "${1:-}" in
    -h|--help) print_header "${BASH_SOURCE[0]}"; exit 0 ;;
    "") ;;
    *) log "unknown argument: $1 (try -h)"; exit 2 ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
PY="$ROOT/.venv/bin/python"
VVENV="$ROOT/.venv-vllm"
THREADS=${THREADS:-2}
NUM_PROMPTS=${NUM_PROMPTS:-32}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-64}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-8}
REQUEST_RATE=${REQUEST_RATE:-inf}
ENGINES=${ENGINES:-"chatserve vllm"}
CLIENTS=${CLIENTS:-"chatserve vllm"}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048}
KV_GB=${KV_GB:-2}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-1200}
OUT_DIR=${OUT_DIR:-"$ROOT/build/compare_bench_serve/$(date -u +%Y%m%d-%H%M%S)"}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

[ -x "$PY" ] || { log "no .venv: run scripts/setup_env.sh first"; exit 2; }
have_vllm() { "$VVENV/bin/python" -c 'import vllm' >/dev/null 2>&1; }
for e in $ENGINES $CLIENTS; do
    case $e in chatserve) ;; vllm) have_vllm || { log "vllm asked for but $VVENV has no vLLM: run benchmarks/peers/compare_vllm.sh once"; exit 2; } ;;
        *) log "unknown engine or client: $e (chatserve or vllm)"; exit 2 ;; esac
done

GGUF=$("$PY" -c 'from chatserve.models.loader import default_model_path; print(default_model_path())')
MODEL_NAME=$(basename "$GGUF" .gguf | sed -E 's/[.-]((I?Q[0-9][A-Z0-9_]*)|F16|F32|BF16)$//I')
HF_DIR=${HF_DIR:-"$HOME/.cache/chatserve/$MODEL_NAME-bf16"}
"$PY" benchmarks/peers/gguf_to_hf.py "$GGUF" "$HF_DIR" 2>&1 | grep -v -E 'it/s\]|Loading a GGUF' >&2 || true
[ -f "$HF_DIR/config.json" ] || { log "converting $GGUF to $HF_DIR failed"; exit 1; }
mkdir -p "$OUT_DIR"
install_cleanup

start_engine() {  # engine port
    case $1 in
        chatserve)
            start_server chatserve "$OUT_DIR/chatserve.log" "$PY" -m chatserve serve "$GGUF" --host 127.0.0.1 --port "$2" \
                --num-threads "$THREADS" --max-model-len "$MAX_MODEL_LEN" --served-model-name "$MODEL_NAME" \
                --dtype bfloat16 --quantization none --kv-cache-memory-gb "$KV_GB" --log-level warning ;;
        vllm)
            start_server vllm "$OUT_DIR/vllm.log" env VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" \
                VLLM_CPU_KVCACHE_SPACE="$KV_GB" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
                "$VVENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
                --served-model-name "$MODEL_NAME" --dtype bfloat16 --enable-prefix-caching \
                --max-model-len "$MAX_MODEL_LEN" --host 127.0.0.1 --port "$2" --seed 0 \
                --disable-uvicorn-access-log --uvicorn-log-level warning ;;
    esac
}

# The same benchmark, in the two tools' spellings (ours takes vLLM's flags; vLLM's random dataset
# needs a tokenizer to draw token ids).
COMMON=(--backend openai --model "$MODEL_NAME" --dataset-name random --random-input-len "$INPUT_LEN"
        --random-output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" --max-concurrency "$MAX_CONCURRENCY"
        --request-rate "$REQUEST_RATE" --ignore-eos --seed 0 --save-result --result-dir "$OUT_DIR")
run_client() {  # client engine url
    local client=$1 engine=$2 url=$3 name="$2-by-$1.json"
    log "$client bench serve against $engine"
    case $client in
        chatserve) run_child "$PY" -m chatserve bench serve --base-url "$url" "${COMMON[@]}" --disable-tqdm \
                       --result-filename "$name" --label "$engine" ;;
        # NOTE: vllm-cpu's `vllm` entry point asks importlib for the "vllm" distribution's version (it is
        # installed as "vllm-cpu") and dies before parsing; the same CLI runs with that one lookup answered.
        vllm) run_child env VLLM_NO_USAGE_STATS=1 "$VVENV/bin/python" -c '
import importlib.metadata as m, sys
version = m.version
m.version = lambda name: version("vllm-cpu") if name == "vllm" else version(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()' bench serve --base-url "$url" "${COMMON[@]}" --tokenizer "$HF_DIR" --disable-tqdm --result-filename "$name" ;;
    esac
}

for ENGINE in $ENGINES; do
    PORT=$(free_port)
    start_engine "$ENGINE" "$PORT"
    wait_ready "$ENGINE" "http://127.0.0.1:$PORT/v1/models" "$OUT_DIR/$ENGINE.log" "$STARTUP_TIMEOUT"
    log "$ENGINE up on port $PORT"
    for CLIENT in $CLIENTS; do
        run_client "$CLIENT" "$ENGINE" "http://127.0.0.1:$PORT" || log "$CLIENT against $ENGINE failed"
    done
    stop_server "$ENGINE"
done

{
    echo "# bench serve: $NUM_PROMPTS random prompts, $INPUT_LEN -> $OUTPUT_LEN tokens, max concurrency $MAX_CONCURRENCY," \
        "rate $REQUEST_RATE; $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, $THREADS threads, load average $(cut -d' ' -f1-3 /proc/loadavg)"
    "$PY" - "$OUT_DIR" "$ENGINES" "$CLIENTS" <<'EOF'
import json, os, sys
out, engines, clients = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
keys = ["completed", "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "median_itl_ms", "total_output_tokens"]
cols = [(e, c) for e in engines for c in clients]
results = {}
for e, c in cols:
    path = os.path.join(out, f"{e}-by-{c}.json")
    results[(e, c)] = json.load(open(path)) if os.path.exists(path) else {}
head = ["key"] + [f"{e} server, {c} client" for e, c in cols]
rows = [head] + [[k] + [("-" if results[col].get(k) is None else f"{results[col][k]:,.2f}") for col in cols] for k in keys]
widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
for i, r in enumerate(rows):
    print("| " + " | ".join(x.ljust(w) for x, w in zip(r, widths)) + " |")
    if i == 0:
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
EOF
} | tee "$OUT_DIR/summary.md"
log "results in $OUT_DIR"
