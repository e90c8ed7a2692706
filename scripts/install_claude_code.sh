#!/usr/bin/env bash
# Install the Claude Code CLI the Anthropic client tests drive (tests/clients/test_client_compat_anthropic.py)
# from the npm registry into a cached folder. Idempotent: a no-op (a few ms) when that version answers.
#
#   scripts/install_claude_code.sh            install (or check) @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION
#
# The result is one launcher, $CLAUDE_CODE_DIR/bin/claude (tests/helpers/claude_code.py runs it).
#
# The package declares Node >= 22. Its `claude` is a native binary (a per-platform optional dependency
# that its postinstall copies over bin/claude.exe), so it runs whatever Node npm has; the check is that
# `claude --version` answers with the version. Where it does not (an npm that skipped the postinstall,
# a Node it refuses), npm's `node@22` package is installed beside it and the package's own postinstall
# and launcher (cli-wrapper.cjs) run under that Node instead.
#
# If the npm registry cannot be reached, this prints why and exits 0, so the rest of the set-up goes on;
# the tests that need the CLI then fail and say how to install it. Any other failure exits non-zero.
#
# Environment:
#   CLAUDE_CODE_VERSION   default 2.1.328
#   CLAUDE_CODE_DIR       default <repo>/.cache/claude-code (git-ignored)
#   CLAUDE_CODE_NODE22=1  use the node@22 fallback even where the binary runs (to test that path)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${CLAUDE_CODE_VERSION:-2.1.328}"
DEST="${CLAUDE_CODE_DIR:-$ROOT/.cache/claude-code}"
PKG="$DEST/pkg"          # npm --prefix: node_modules/@anthropic-ai/claude-code
NODE22="$DEST/node22"    # npm --prefix: node_modules/node (npm's node@22), only when needed
LAUNCHER="$DEST/bin/claude"
PKG_DIR="$PKG/node_modules/@anthropic-ai/claude-code"

log() { echo "[install_claude_code] $*" >&2; }

answers() {  # "$@" --version prints "<VERSION> (Claude Code)"
    local out
    out="$(timeout 60 "$@" --version 2>/dev/null </dev/null)" || return 1
    [[ "$out" == "$VERSION "* ]]
}

if [[ -x "$LAUNCHER" ]] && answers "$LAUNCHER"; then
    log "claude $VERSION present ($LAUNCHER)"
    exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
    log "WARNING: npm not found: Claude Code not installed (the Claude Code tests will fail; install Node.js and npm, then rerun $0)"
    exit 0
fi

# Reachability first, so that "the registry cannot be reached" (non-fatal) is told apart from a broken install (fatal).
if ! probe="$(timeout 120 npm view --fetch-retries=1 "@anthropic-ai/claude-code@$VERSION" version 2>&1)" || [[ "$probe" != *"$VERSION"* ]]; then
    log "WARNING: the npm registry did not answer for @anthropic-ai/claude-code@$VERSION: Claude Code not installed"
    log "  npm said: $(head -n 3 <<<"$probe" | tr "\n" " ")"
    log "  (the Claude Code tests will fail until $0 succeeds)"
    exit 0
fi

NPM_FLAGS=(--no-audit --no-fund --no-update-notifier --loglevel=error)
log "installing @anthropic-ai/claude-code@$VERSION into $PKG (node $(node --version 2>/dev/null || echo '?'))"
rm -rf "$DEST/bin"
mkdir -p "$PKG" "$DEST/bin"
# A package.json of its own, so npm installs here and not into an enclosing project.
[[ -f "$PKG/package.json" ]] || echo '{"name": "chatserve-claude-code", "private": true}' > "$PKG/package.json"
timeout 600 npm install "${NPM_FLAGS[@]}" --prefix "$PKG" "@anthropic-ai/claude-code@$VERSION" >&2

write_launcher() {  # the command line the launcher execs, as one quoted string
    printf '#!/usr/bin/env bash\n# Written by scripts/install_claude_code.sh: Claude Code %s.\nexec %s "$@"\n' "$VERSION" "$1" > "$LAUNCHER"
    chmod +x "$LAUNCHER"
}

if [[ "${CLAUDE_CODE_NODE22:-0}" != 1 ]] && answers "$PKG_DIR/bin/claude.exe"; then
    write_launcher "\"$PKG_DIR/bin/claude.exe\""
    log "claude $VERSION installed: $LAUNCHER (native binary; node $(node --version 2>/dev/null || echo '?') only ran its installer)"
    exit 0
fi

# The fallback: npm's node@22 package, then the package's postinstall and launcher under it.
if [[ "${CLAUDE_CODE_NODE22:-0}" == 1 ]]; then
    log "CLAUDE_CODE_NODE22=1: installing npm's node@22 into $NODE22"
else
    log "claude.exe did not answer --version under node $(node --version 2>/dev/null || echo '?'): installing npm's node@22 into $NODE22"
fi
mkdir -p "$NODE22"
[[ -f "$NODE22/package.json" ]] || echo '{"name": "chatserve-node22", "private": true}' > "$NODE22/package.json"
timeout 600 npm install "${NPM_FLAGS[@]}" --prefix "$NODE22" "node@22" >&2
NODE="$NODE22/node_modules/node/bin/node"
[[ -x "$NODE" ]] || NODE="$NODE22/node_modules/.bin/node"
if ! "$NODE" --version >/dev/null 2>&1; then
    log "ERROR: npm's node@22 does not run ($NODE)"
    exit 1
fi
log "node $("$NODE" --version) from npm; rerunning Claude Code's postinstall with it"
(cd "$PKG_DIR" && "$NODE" install.cjs >&2) || log "its postinstall failed under node 22 too; trying its launcher"
if [[ "${CLAUDE_CODE_NODE22:-0}" != 1 ]] && answers "$PKG_DIR/bin/claude.exe"; then
    write_launcher "\"$PKG_DIR/bin/claude.exe\""
elif answers "$NODE" "$PKG_DIR/cli-wrapper.cjs"; then
    write_launcher "\"$NODE\" \"$PKG_DIR/cli-wrapper.cjs\""
else
    log "ERROR: Claude Code $VERSION does not answer --version, neither natively nor under node 22"
    exit 1
fi
log "claude $VERSION installed: $LAUNCHER (under npm's node $("$NODE" --version))"
