# Shell helpers shared by the compare_*.sh scripts (peers/, serving/): sourced, never run.
#
# Why one file: every comparison starts servers on free ports, waits for them, runs benchmark
# clients that Ctrl-C must be able to interrupt, and stops every server it started whatever
# happens. Written once, those rules cannot drift apart between the scripts.
#
# The sourcing script sets LOG_TAG (its name in log lines) and, before calling free_port or
# wait_ready, PY (a python with httpx). It calls install_cleanup once, before starting anything.

# The comment block at the top of a script (from line 2 to `set -euo pipefail`), as its -h text.
print_header() {  # script
    sed -n '2,/^set -euo pipefail/p' "$1" | sed '$d; s/^# \{0,1\}//'
}

log() { printf '[%s] %s\n' "${LOG_TAG:-compare}" "$*" >&2; }

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# ---- servers: started in the background, remembered by name, stopped on exit ----------------------
declare -A SERVER_PIDS=()  # name -> pid of every server started and not yet stopped
CHILD_PID=""               # the benchmark client running now

start_server() {  # name logfile command...: runs it in the background; its pid is SERVER_PIDS[name]
    local name=$1 logf=$2; shift 2
    "$@" >"$logf" 2>&1 &
    SERVER_PIDS[$name]=$!
}

stop_server() {  # name: SIGTERM, up to 20 s to exit, then SIGKILL
    local name=$1 pid=${SERVER_PIDS[$1]:-}
    unset 'SERVER_PIDS[$name]'
    [ -n "$pid" ] || return 0
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; log "stopped $name"; return 0; }
        sleep 0.2
    done
    log "$name did not stop after SIGTERM; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

_cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    [ -n "$CHILD_PID" ] && kill -TERM "$CHILD_PID" 2>/dev/null
    local name
    for name in "${!SERVER_PIDS[@]}"; do
        stop_server "$name"
    done
    exit "$rc"
}

install_cleanup() {
    trap _cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}

# NOTE: bash runs a trap only after the foreground command returns, so long children run in the
# background and are waited for: `wait` returns as soon as a signal arrives.
run_child() {
    "$@" &
    CHILD_PID=$!
    local rc=0
    wait "$CHILD_PID" || rc=$?
    CHILD_PID=""
    return "$rc"
}

wait_ready() {  # name url logfile [seconds]: until url answers 200; exits if the server dies first
    local name=$1 url=$2 logf=$3 limit=${4:-450} pid=${SERVER_PIDS[$1]}
    local i
    for ((i = 0; i < limit * 2; i++)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            log "$name exited during startup; its log:"; tail -n 40 "$logf" >&2; exit 1
        fi
        if "$PY" -c "import httpx,sys; sys.exit(0 if httpx.get('$url', timeout=2).status_code == 200 else 1)" 2>/dev/null; then
            return 0
        fi
        sleep 0.5
    done
    log "$name not ready after $limit s; its log:"; tail -n 40 "$logf" >&2; exit 1
}

# ---- memory of a server and all its descendants (vLLM's engine core is a child process) ----------
tree_pids() {  # pid: it and every descendant, one a line
    local p=$1 c
    echo "$p"
    for c in $(ps -o pid= --ppid "$p" 2>/dev/null); do
        tree_pids "$c"
    done
}

# Sum of one /proc field in kB over the tree: VmRSS or VmHWM (status), or Pss (smaps_rollup).
# RSS sums count pages shared between the processes once per process; PSS splits them.
tree_mem_kb() {  # pid field
    local total=0 p v file=status
    [ "$2" = Pss ] && file=smaps_rollup
    for p in $(tree_pids "$1"); do
        v=$(awk -v k="$2:" '$1 == k { print $2; exit }' "/proc/$p/$file" 2>/dev/null || true)
        total=$((total + ${v:-0}))
    done
    echo "$total"
}
