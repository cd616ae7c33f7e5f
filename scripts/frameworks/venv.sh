#!/usr/bin/env bash
# Builds the separate venv that `make frameworks` runs the training frameworks in.
# It is never ckptool's .venv and never a dependency of ckptool: ckptool runs from its own venv and reads what
# these frameworks wrote. Location: $CKPTOOL_FRAMEWORKS_VENV, by default ~/.cache/ckptool-frameworks/venv.
# Built once: a stamp file records the package list; a changed list installs the new one over it. A second
# caller waits on a lock while a first one builds.
set -euo pipefail

# the whole script is one function, parsed before it runs: editing this file under a running build is safe
main() {
  VENV="${CKPTOOL_FRAMEWORKS_VENV:-$HOME/.cache/ckptool-frameworks/venv}"
  PYTHON="${PYTHON:-python3}"
  # torch pinned to the release ckptool is tested with; the frameworks at what pip resolves against it
  TORCH="torch==2.14.1 torchvision==0.29.1"
  FRAMEWORKS="lightning transformers accelerate timm mmengine ultralytics safetensors diffusers peft"
  STAMP="$VENV/.ckptool-frameworks-installed"
  WANT="$TORCH $FRAMEWORKS"
  mkdir -p "$(dirname "$VENV")"
  exec 9>"$VENV.lock"
  flock 9
  if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    exit 0
  fi
  if [[ ! -f "$VENV/pyvenv.cfg" ]]; then
    if [[ -e "$VENV" ]]; then
      echo "venv.sh: $VENV exists and is not a venv; set CKPTOOL_FRAMEWORKS_VENV to another path" >&2
      exit 2
    fi
    "$PYTHON" -m venv "$VENV"
  fi
  # an interrupted build is resumed: pip installs what is missing
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # torch first, alone: the frameworks then resolve against the installed release instead of pulling another
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install --quiet $TORCH
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pip install --quiet $TORCH $FRAMEWORKS
  echo "$WANT" > "$STAMP"
}

main "$@"
