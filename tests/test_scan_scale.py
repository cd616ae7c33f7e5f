"""scan of large trees and archives in flat memory: the peak of a child process, measured, not timed.

A tree of 100,000 files must peak about where one of 10,000 does (the report keeps counts and
findings, not every file; each file's cyclic garbage is collected as the scan goes), and an archive of
10,000 members is read a member at a time, never whole. The margins are generous: only a scan whose
memory grows with the files or the bytes scanned fails them.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak from /proc")
MIB = 1 << 20
DANGEROUS = b"cos\nsystem\n(S'echo hi'\ntR."  # names os.system: never executed, only read


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


# ckptool's command in a child that reports its own peak (VmHWM, which exec resets: a forked child's ru_maxrss
# would start at the size of the test process that forked it)
CHILD = """
import sys
from ckptool.cli.main import main
try:
    main(sys.argv[1:], prog_name="ckptool")
except SystemExit as e:
    code = e.code
peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]
sys.stderr.write(f"peak-kb {peak}\\n")
sys.exit(code)
"""


def peak_scan(*args: object) -> tuple[int, str, int]:
    """``ckptool scan ARGS`` in a child: (exit code, stdout, the child's peak resident memory in bytes)."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "scan", *map(str, args)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
    )
    peak = [line for line in done.stderr.splitlines() if line.startswith("peak-kb ")]
    assert peak, done.stderr[-2000:]
    return done.returncode, done.stdout, int(peak[-1].split()[1]) * 1024


def make_tree(root: Path, files: int, pickle_every: int = 20) -> None:
    """``files`` small files in folders of 1,000: text files, every ``pickle_every``-th a small safe pickle,
    and one dangerous pickle at the end."""
    safe = pickle.dumps({"weights": [1.0, 2.0], "step": 3}, protocol=2)
    for start in range(0, files, 1000):
        folder = root / f"part{start // 1000:03d}"
        folder.mkdir(parents=True)
        for i in range(start, min(files, start + 1000)):
            is_pickle = i % pickle_every == 0
            fd = os.open(folder / (f"f{i:06d}.pkl" if is_pickle else f"f{i:06d}.txt"), os.O_WRONLY | os.O_CREAT)
            os.write(fd, safe if is_pickle else b"a note, no checkpoint\n")
            os.close(fd)
    (root / "zz_bad.pkl").write_bytes(DANGEROUS)


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tree of 10,000 files and one of 100,000 (see make_tree), made once for both ways of scanning."""
    root = tmp_path_factory.mktemp("trees")
    make_tree(root / "small", 10_000)
    make_tree(root / "large", 100_000)
    return root / "small", root / "large"


@pytest.mark.parametrize("jobs", ["1", "2"], ids=["in-process", "worker-processes"])
def test_a_tree_of_100000_files_peaks_where_10000_do(trees: tuple[Path, Path], jobs: str) -> None:
    """The command's own peak: with -j 1 it judges every file itself; with -j 2 it walks, keeps a window
    of items in flight and takes their results (the workers judge them)."""
    small, large = trees
    code, out, small_peak = peak_scan(small, "-j", jobs)
    assert code == 1 and out.startswith(
        "scanned 1 path(s): 501 judged (500 safe, 0 unknown, 1 dangerous), 0 unreadable, 9500 skipped"
    ), out[:300]
    code, out, large_peak = peak_scan(large, "-j", jobs)
    assert code == 1 and out.startswith(
        "scanned 1 path(s): 5001 judged (5000 safe, 0 unknown, 1 dangerous), 0 unreadable, 95000 skipped"
    ), out[:300]
    assert f"DANGEROUS   {large}/zz_bad.pkl" in out and "os.system" in out
    assert "--json lists the first 1000" in out
    # 5,000 pickles' garbage kept, or every file's result kept, is over 100 MiB here
    assert large_peak < small_peak + 40 * MIB, (small_peak // MIB, large_peak // MIB)


def test_the_json_document_of_a_large_tree_lists_the_first_skipped(tmp_path: Path) -> None:
    import json

    make_tree(tmp_path / "tree", 3000, pickle_every=1000)
    code, out, _ = peak_scan(tmp_path / "tree", "--json")
    data = json.loads(out)
    assert code == 1 and data["counts"]["skipped"] == 2997 and data["counts"]["safe"] == 3
    assert len(data["skipped"]) == 1000 and data["skipped_unlisted"] == 1997
    assert data["skipped"][0]["path"] == f"{tmp_path}/tree/part000/f000001.txt"  # the first, in the order walked
    assert [item["verdict"] for item in data["items"]] == ["dangerous"] + ["safe"] * 3  # a folder's files first
    from jsonschema import validate

    validate(data, json.loads((REPO / "ckptool/schemas/scan2.schema.json").read_text()))


@pytest.mark.parametrize("kind", ["npz", "npz-compressed", "torch"])
def test_an_archive_of_10000_members_is_read_a_member_at_a_time(tmp_path: Path, kind: str) -> None:
    """10,000 arrays of 16 KiB (160 MiB): the scan peaks far below the data (each member's header and
    pickle read, not its data held), and one of the arrays holding a pickle is still found."""
    import numpy as np

    arrays = {f"a{i}": np.full(4096, i, dtype=np.float32) for i in range(10_000)}
    folder = tmp_path / "archives"
    folder.mkdir()
    (folder / "notes.txt").write_text("no checkpoint\n")
    if kind == "torch":
        import torch

        torch.save({name: torch.from_numpy(array) for name, array in arrays.items()}, folder / "many.pt")
        expected = "1 judged (1 safe, 0 unknown, 0 dangerous)"
    else:
        arrays["zz_objects"] = np.array([os.system], dtype=object)  # a pickle naming os.system: numpy.load runs it
        (np.savez_compressed if kind == "npz-compressed" else np.savez)(folder / "many.npz", **arrays)
        expected = "1 judged (0 safe, 0 unknown, 1 dangerous)"
    data_bytes = 10_000 * 4096 * 4  # inflated
    code, out, peak = peak_scan(folder)
    assert code == (0 if kind == "torch" else 1)
    assert out.startswith(f"scanned 1 path(s): {expected}, 0 unreadable, 1 skipped"), out[:400]
    assert peak < 100 * MIB and peak < data_bytes / 2, (peak // MIB, data_bytes // MIB)


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_tree_scan_counts_its_files_on_a_terminal_only(tmp_path: Path) -> None:
    from test_progress import run_on_terminal  # stderr on a pseudo-terminal, the bar's delay 0

    make_tree(tmp_path / "tree", 300)
    code, stdout, terminal = run_on_terminal(tmp_path, "scan", tmp_path / "tree")
    assert code == 1 and stdout.startswith("scanned 1 path(s): 16 judged"), stdout[:300]
    assert b"scanned: " in terminal and b"301 files" in terminal, terminal[-500:]  # every item counted
    assert b"\n" not in terminal  # the count is removed when the scan ends
    for quiet in ("--json", "-q"):
        code, stdout, terminal = run_on_terminal(tmp_path, "scan", tmp_path / "tree", quiet)
        assert code == 1 and terminal == b"", (quiet, terminal[-300:])
    piped = subprocess.run(
        [sys.executable, "-m", "ckptool", "scan", tmp_path / "tree"], capture_output=True, env=_env(), check=False
    )
    assert piped.returncode == 1 and piped.stderr == b""


def test_a_prefix_scan_reads_headers_and_pickles_not_tensor_data(tmp_path: Path) -> None:
    """A store's prefix holding a 32 MiB safetensors file and a 32 MiB .pt: the scan reads the header and
    the pickle of each (the store counts every byte), not the tensors' data."""
    import json
    import uuid

    import fsspec
    import torch
    from click.testing import CliRunner
    from jsonschema import validate
    from safetensors.torch import save_file

    from ckptool.cli.main import main

    weights = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(8)}  # 32 MiB
    save_file(weights, tmp_path / "model.safetensors")
    torch.save({"model": weights, "step": 3}, tmp_path / "model.pt")
    fs = fsspec.filesystem("memory")
    base = f"/t{uuid.uuid4().hex[:12]}"
    try:
        for name in ("model.safetensors", "model.pt"):
            fs.pipe(f"{base}/models/{name}", (tmp_path / name).read_bytes())
        fs.pipe(f"{base}/models/notes/README.md", b"a note\n")
        data_bytes = sum((tmp_path / name).stat().st_size for name in ("model.safetensors", "model.pt"))
        result = CliRunner().invoke(main, ["scan", f"memory://{base}/models", "--json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        validate(data, json.loads((REPO / "ckptool/schemas/scan2.schema.json").read_text()))
        assert data["counts"] == {"safe": 2, "unknown": 0, "dangerous": 0, "unreadable": 0, "skipped": 1}
        # the header, the zip's directory and the pickle, in the reader's windows: ~1 MiB a file, whatever the data
        assert 0 < data["io"]["bytes_read"] <= 4 << 20 and data["io"]["bytes_read"] < data_bytes / 16, data["io"]
    finally:
        fs.rm(base, recursive=True)


def test_a_compressed_plain_array_is_judged_by_its_header_never_inflated(tmp_path: Path) -> None:
    """A 128 MiB array of zeros deflates ~1000-fold: its header says it holds numbers, so it is not
    inflated (nor refused as a bomb); the archive's object array is still found."""
    import numpy as np

    folder = tmp_path / "archive"
    folder.mkdir()
    (folder / "notes.txt").write_text("no checkpoint\n")
    np.savez_compressed(
        folder / "big.npz", zeros=np.zeros(32 << 20, dtype=np.float32), objects=np.array([os.system], dtype=object)
    )
    code, out, peak = peak_scan(folder)
    assert code == 1 and out.startswith("scanned 1 path(s): 1 judged (0 safe, 0 unknown, 1 dangerous)"), out[:400]
    assert peak < 100 * MIB, peak // MIB
