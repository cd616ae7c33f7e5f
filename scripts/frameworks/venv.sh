#!/usr/bin/env bash
# Builds the separate venv that `make frameworks` runs the training frameworks in.
# It is never ckptool's .venv and never a dependency of ckptool: ckptool itself runs from its own venv and reads
# what these frameworks wrote. Location: $CKPTOOL_FRAMEWORKS_VENV or ~/.cache/ckptool-frameworks/venv.
# Rebuilds only when this file changed since the last complete build (a stamp file records its hash).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${CKPTOOL_FRAMEWORKS_VENV:-$HOME/.cache/ckptool-frameworks/venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.ckptool-frameworks-installed"
WANT="$(sha256sum "$HERE/venv.sh" | cut -d' ' -f1)"
LOCK="$(dirname "$VENV")/.venv.lock"
mkdir -p "$(dirname "$VENV")"
exec 9>"$LOCK"
flock 9  # a second caller waits for a half-built venv instead of building it twice
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# torch and torchvision first, pinned to the release ckptool is tested with; the frameworks then resolve against it
"$VENV/bin/python" -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
"$VENV/bin/python" -m pip install --quiet \
  "torch==2.14.1" "torchvision==0.29.1" \
  lightning transformers accelerate timm mmengine ultralytics safetensors
echo "$WANT" > "$STAMP"
