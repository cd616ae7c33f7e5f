#!/usr/bin/env bash
# The peer scanners' virtual environment, outside the repository (they must never share ckptool's venv:
# modelscan and modelaudit pin numpy/h5py/tensorflow-adjacent versions of their own).
#
#   bash bench/peers/venv.sh [VENV]        # default /work/peers-venv
#
# Installs each scanner on its own so one failure does not stop the rest, then records the exact
# versions in bench/peers/versions.json (read by run.py into results.json).
set -u
VENV="${1:-/work/peers-venv}"
HERE="$(cd "$(dirname "$0")" && pwd)"
# picklescan's 7z extra (py7zr): without it picklescan stops on the .7z files of its own corpus
PEERS=("picklescan[7z]" modelscan fickling modelaudit)

python3.11 -m venv "$VENV" || exit 1
"$VENV/bin/python" -m pip install --quiet --upgrade pip
status=0
for peer in "${PEERS[@]}"; do
    if ! "$VENV/bin/python" -m pip install --quiet "$peer"; then
        echo "venv.sh: $peer failed to install (see pip's output above); the others go on" >&2
        status=1
    fi
done
"$VENV/bin/python" - "$HERE/versions.json" picklescan modelscan fickling modelaudit py7zr <<'PY'
import json, sys
from importlib import metadata
out, peers = sys.argv[1], sys.argv[2:]
versions = {"python": sys.version.split()[0]}
for peer in peers:
    try:
        versions[peer] = metadata.version(peer)
    except metadata.PackageNotFoundError:
        versions[peer] = None
with open(out, "w") as handle:
    json.dump(versions, handle, indent=2, sort_keys=True)
    handle.write("\n")
print(json.dumps(versions))
PY
exit $status
