#!/usr/bin/env bash
# Native llama.cpp and ik_llama.cpp binaries, built from pinned PyPI source distributions.
#
#   benchmarks/peers/build_native.sh              # build both (cached: a second run prints the paths at once)
#   benchmarks/peers/build_native.sh mainline     # only mainline llama.cpp
#   benchmarks/peers/build_native.sh ik           # only ik_llama.cpp
#   benchmarks/peers/build_native.sh --print-dir NAME   # the binaries' folder of NAME (mainline|ik), nothing built
#
# Why: numbers measured through llama-cpp-python's Python loop understate llama.cpp. These are the
# engines' own binaries (llama-bench for engine speed, llama-server for serving):
#   mainline: the llama.cpp tree vendored in llama-cpp-python==$LLAMACPP_VERSION's sdist:
#             llama-bench, llama-batched-bench, llama-server
#   ik:       ik_llama.cpp vendored in ik-llama-cpp-python==$IK_VERSION's sdist:
#             llama-bench, llama-sweep-bench, llama-batched-bench, llama-server
#             (that sdist lacks common/cmake/build-info-gen-cpp.cmake: we write common/build-info.cpp)
# Sources come through `pip download --no-deps --no-binary :all:`; nothing of their code is committed.
# Release, CPU only: no CUDA, no curl, no OpenSSL, no web UI download; static libraries.
#
# The ISA rule (same as compare_llamacpp.sh): never -march=native on a CPU whose /proc/cpuinfo lists
# AMX (VMs can advertise AMX without enabling its tile state: ggml's AMX kernels then fault at
# ldtilecfg). There the build names the ISA extensions cpuinfo lists, AMX off; elsewhere GGML_NATIVE.
#
# Each build lives in $NATIVE_CACHE/<name>-<version>-<hash of cmake flags + compiler>/bin; a stamp
# file marks it complete, so a second run is instant. About ten minutes per engine on 2 cores.
#
# Knobs (environment): NATIVE_CACHE (default ~/.cache/chatserve-native), JOBS (default 2),
# LLAMACPP_VERSION (0.3.36), IK_VERSION (0.1.5), PIP (a python -m pip; default python3 -m pip),
# EXTRA_CMAKE_ARGS. Run it under `nice -n 19 ionice -c3` on a shared machine.
set -euo pipefail

LLAMACPP_VERSION=${LLAMACPP_VERSION:-0.3.36}
IK_VERSION=${IK_VERSION:-0.1.5}
NATIVE_CACHE=${NATIVE_CACHE:-"$HOME/.cache/chatserve-native"}
JOBS=${JOBS:-2}
EXTRA_CMAKE_ARGS=${EXTRA_CMAKE_ARGS:-}

log() { printf '[build_native] %s\n' "$*" >&2; }
# shellcheck source=benchmarks/peers/ggml_isa.sh
source "$(dirname "${BASH_SOURCE[0]}")/ggml_isa.sh"

# The ggml ISA cmake flags for a /proc/cpuinfo "flags" line (argument; default: this CPU's).
# AMX listed -> GGML_NATIVE=OFF, every extension named, AMX explicitly off. Otherwise GGML_NATIVE=ON.
isa_cmake_args() {  # [cpuinfo flags]
    local flags=${1-}
    if [ -z "$flags" ] && [ -r /proc/cpuinfo ]; then
        flags=$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)
    fi
    flags=" $flags "
    has() { case "$flags" in *" $1 "*) return 0 ;; esac; return 1; }
    if ! has amx_tile && ! has amx_int8 && ! has amx_bf16; then
        echo "-DGGML_NATIVE=ON"
        return 0
    fi
    ggml_isa_args "$flags"
}

# name -> pip spec, folder inside the sdist, cmake options, targets (stages split by "|": the
# benchmarks first, so they can run while the server still compiles)
engine_spec() {  # name
    case "$1" in
        mainline)
            SPEC="llama-cpp-python==$LLAMACPP_VERSION"; SUBDIR="vendor/llama.cpp"; VERSION=$LLAMACPP_VERSION
            OPTS="-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
            OPTS+=" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON"
            TARGETS="llama-bench llama-batched-bench|llama-server" ;;
        ik)
            SPEC="ik-llama-cpp-python==$IK_VERSION"; SUBDIR="vendor/ik_llama.cpp"; VERSION=$IK_VERSION
            # IQK_FA_ALL_QUANTS off: flash attention over quantized K/V caches is not measured (f16 caches);
            # it halves the longest compile
            OPTS="-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DGGML_IQK_FA_ALL_QUANTS=OFF"
            TARGETS="llama-bench llama-sweep-bench llama-batched-bench|llama-server" ;;
        *) log "unknown engine: $1 (mainline|ik)"; return 2 ;;
    esac
    OPTS="-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF $OPTS"
    OPTS+=" $(isa_cmake_args) $EXTRA_CMAKE_ARGS"
}

build_dir() {  # name: the cache folder for this engine, version, flags and compiler
    engine_spec "$1"
    local cc hash
    cc=$( (c++ --version 2>/dev/null || echo none) | head -1)
    hash=$(printf '%s\n%s\n' "$OPTS" "$cc" | sha256sum | cut -c1-12)
    echo "$NATIVE_CACHE/$1-$VERSION-$hash"
}

# ik's sdist has common/build-info.cpp.in but not the cmake script that fills it in.
write_ik_build_info() {  # source root
    local root=$1
    mkdir -p "$root/common/cmake"
    cat >"$root/common/build-info.cpp" <<EOF
int LLAMA_BUILD_NUMBER = 0;
char const *LLAMA_COMMIT = "ik-llama-cpp-python-$IK_VERSION";
char const *LLAMA_COMPILER = "$(c++ --version | head -1)";
char const *LLAMA_BUILD_TARGET = "$(uname -m)";
EOF
    # The custom command that would regenerate it runs this script: keep what we wrote.
    [ -f "$root/common/cmake/build-info-gen-cpp.cmake" ] ||
        echo '# written by chatserve build_native.sh: common/build-info.cpp is written ahead' \
            >"$root/common/cmake/build-info-gen-cpp.cmake"
}

build_engine() {  # name: under a lock, so two runs never share one build folder
    local name=$1 dir
    dir=$(build_dir "$name")
    mkdir -p "$NATIVE_CACHE"
    (
        flock 9
        _build_engine_locked "$name" "$dir"
    ) 9>"$dir.lock"
}

_build_engine_locked() {  # name dir
    local name=$1 dir=$2
    engine_spec "$name"
    if [ -f "$dir/COMPLETE" ]; then
        log "$name: cached in $dir/bin"
        echo "$dir/bin"
        return 0
    fi
    local start gen=() src t stage
    start=$(date +%s)
    if [ -f "$dir/build/CMakeCache.txt" ]; then  # a stopped build of the same flags: ninja resumes it
        log "$name: resuming the build in $dir"
    else
        log "$name: building $SPEC into $dir (about ten minutes on 2 cores)"
        log "$name: cmake $OPTS"
        rm -rf "$dir"
        mkdir -p "$dir/dl" "$dir/bin"
        local pip=${PIP:-python3 -m pip}
        $pip download --quiet --no-deps --no-binary :all: "$SPEC" -d "$dir/dl"
        tar -xzf "$dir"/dl/*.tar.gz -C "$dir/dl"
        src=$(find "$dir/dl" -mindepth 1 -maxdepth 1 -type d | head -1)/$SUBDIR
        [ -f "$src/CMakeLists.txt" ] || { log "$name: no $SUBDIR in the sdist"; return 1; }
        [ "$name" = ik ] && write_ik_build_info "$src"
        command -v ninja >/dev/null && gen=(-G Ninja)
        # shellcheck disable=SC2086
        cmake -S "$src" -B "$dir/build" "${gen[@]}" $OPTS >"$dir/cmake.log" 2>&1 ||
            { log "$name: cmake failed, see $dir/cmake.log"; rm -f "$dir/build/CMakeCache.txt"; return 1; }
    fi
    local IFS_SAVE=$IFS
    IFS='|'
    local stages=($TARGETS)
    IFS=$IFS_SAVE
    for stage in "${stages[@]}"; do
        # shellcheck disable=SC2086
        cmake --build "$dir/build" -j "$JOBS" --target $stage >>"$dir/build.log" 2>&1 ||
            { log "$name: build failed, see $dir/build.log"; return 1; }
        for t in $stage; do
            cp "$(find "$dir/build" -name "$t" -type f -perm -u+x | head -1)" "$dir/bin/"
        done
        log "$name: $stage ready in $dir/bin ($(( $(date +%s) - start )) s)"
    done
    printf 'spec=%s\ncmake=%s\nseconds=%s\n' "$SPEC" "$OPTS" "$(( $(date +%s) - start ))" >"$dir/COMPLETE"
    rm -rf "$dir/dl"/*.tar.gz
    log "$name: built in $(( $(date +%s) - start )) s: $dir/bin"
    echo "$dir/bin"
}

main() {
    case "${1:-}" in
        -h|--help) sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; return 0 ;;
        --print-dir) echo "$(build_dir "${2:?--print-dir NAME}")/bin"; return 0 ;;
        "") build_engine mainline; build_engine ik ;;
        *) local n; for n in "$@"; do build_engine "$n"; done ;;
    esac
}

# Sourced (the tests call isa_cmake_args): define only.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main "$@"
fi
