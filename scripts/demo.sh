#!/usr/bin/env bash
# The main job on an embedded default: train LeNet with DDP on 2 CPU processes, then
# inspect -> strip -> convert -> verify the checkpoint it saved. Run via `make demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
OUT=demo-out
rm -rf "$OUT" && mkdir -p "$OUT"
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1. train LeNet with DDP: torchrun, 2 CPU processes (gloo), saved the common way (wrapper keys)"
"$BIN/torchrun" --standalone --nproc-per-node 2 -m training --mode ddp --model lenet --epochs 2 --device cpu \
    --save-style wrapped --out "$OUT/ddp.pt"

step "2. inspect: what the training run left in the checkpoint"
"$BIN/ckptool" inspect "$OUT/ddp.pt"

step "3. verify against the bare model: fails, and names the fix (exit 1 expected)"
"$BIN/ckptool" verify "$OUT/ddp.pt" --model training:lenet || echo "(exit $?: as expected)"

step "4. strip the DDP prefix (optimizer, epoch, config and metrics kept)"
"$BIN/ckptool" strip "$OUT/ddp.pt" -o "$OUT/model.pt"

step "5. convert to safetensors (no pickle; re-read and checked; sha256 fingerprint of the weights)"
"$BIN/ckptool" convert "$OUT/model.pt" -o "$OUT/model.safetensors" --fingerprint

step "6. verify: loads strictly, evaluates identically on every device, matches its source"
"$BIN/ckptool" verify "$OUT/model.safetensors" --model training:lenet --against "$OUT/model.pt"

step "done: outputs in $OUT/"
ls -l "$OUT"
