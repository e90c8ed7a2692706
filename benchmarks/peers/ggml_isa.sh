# shellcheck shell=bash
# The ggml CMake options naming each x86 ISA extension a CPU lists, AMX always off: what native
# llama.cpp builds use instead of -march=native / GGML_NATIVE where the CPU lists AMX. Why: on VMs that
# advertise AMX without enabling its tile state (a Firecracker dev box) ggml's AMX kernels die at
# `ldtilecfg` (a silent segfault at the first matmul). Sourced by build_native.sh and compare_llamacpp.sh.
ggml_isa_args() {  # "cpuinfo flags" (space-separated)
    local flags=" $1 " args="-DGGML_NATIVE=OFF"
    _has() { case "$flags" in *" $1 "*) return 0 ;; esac; return 1; }
    _has avx && args+=" -DGGML_AVX=ON"
    _has avx2 && args+=" -DGGML_AVX2=ON"
    _has bmi2 && args+=" -DGGML_BMI2=ON"
    _has fma && args+=" -DGGML_FMA=ON"
    _has f16c && args+=" -DGGML_F16C=ON"
    _has avx_vnni && args+=" -DGGML_AVX_VNNI=ON"
    _has avx512f && args+=" -DGGML_AVX512=ON"
    _has avx512vbmi && args+=" -DGGML_AVX512_VBMI=ON"
    _has avx512_vnni && args+=" -DGGML_AVX512_VNNI=ON"
    _has avx512_bf16 && args+=" -DGGML_AVX512_BF16=ON"
    echo "$args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}
