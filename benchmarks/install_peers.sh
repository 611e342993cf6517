#!/usr/bin/env bash
# Install the peers of `speculant bench peers` (llama-cpp-python, transformers) into a venv.
#
#     benchmarks/install_peers.sh [VENV]     (default: .venv)
#
# llama.cpp is compiled for the vector extensions this CPU has, listed one by one, never with
# -march=native: on Intel Xeons that advertise AMX a native build turns AMX on and segfaults on
# its first forward. AVX-512 parts are added only where /proc/cpuinfo lists them. The build
# takes about 10 minutes on 2 cores.
set -euo pipefail
venv=$(cd "${1:-.venv}" && pwd)
cd "$(dirname "$0")/.."
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]]; }

args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 avx512vbmi:AVX512_VBMI \
            avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
    if has "${pair%%:*}"; then args+=" -DGGML_${pair#*:}=ON"; else args+=" -DGGML_${pair#*:}=OFF"; fi
done
echo "building llama-cpp-python with CMAKE_ARGS=$args"
# --no-cache-dir: pip would otherwise reuse a wheel it built earlier with other flags.
CMAKE_ARGS="$args" "$venv/bin/pip" install --no-cache-dir --force-reinstall --no-deps "llama-cpp-python>=0.3"
"$venv/bin/pip" install -e ".[peers]"
