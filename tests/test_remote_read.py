"""URLs as inputs: every command reads a checkpoint where it lives, by ranges, as it reads a local file.

Two stores: fsspec's ``memory://`` (fast, every format and command) and a real HTTP server on a free
loopback port with ``Range`` support (how ``https://`` inputs are read), which counts the requests
and bytes it serves. Each command's result on a URL is compared with the same command on the same
file on disk: the same weights (fingerprints), the same findings.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

fsspec = pytest.importorskip("fsspec", reason="URLs need the remote extra (fsspec)")
torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

import ckptool  # noqa: E402
from ckptool.cli.main import main  # noqa: E402
from ckptool.files.remote import STATS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"


def cli(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


# ---------------------------------------------------------------------------------------------
# stores


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.lock = threading.Lock()
        self.requests = 0
        self.bytes_sent = 0

    def reset(self) -> None:
        with self.lock:
            self.requests = self.bytes_sent = 0


class _Handler(BaseHTTPRequestHandler):
    """Static files with HEAD and single ``Range: bytes=a-b`` GETs (206), 404 for anything else."""

    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _file(self) -> Path | None:
        relative = self.path.split("?", 1)[0].lstrip("/")
        path = (self.server.root / relative).resolve()
        if not path.is_relative_to(self.server.root.resolve()) or not path.is_file():
            return None
        return path

    def _count(self, sent: int) -> None:
        with self.server.lock:
            self.server.requests += 1
            self.server.bytes_sent += sent

    def _missing(self) -> None:
        self._count(0)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:  # noqa: N802
        path = self._file()
        if path is None:
            return self._missing()
        self._count(0)
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        path = self._file()
        if path is None:
            return self._missing()
        size = path.stat().st_size
        start, end = 0, size - 1
        wanted = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        if wanted:
            if wanted.group(1):
                start = int(wanted.group(1))
                end = min(size - 1, int(wanted.group(2))) if wanted.group(2) else size - 1
            else:
                start, end = max(0, size - int(wanted.group(2))), size - 1
        with path.open("rb") as handle:
            handle.seek(start)
            data = handle.read(max(0, end - start + 1))
        self._count(len(data))
        self.send_response(206 if wanted else 200)
        if wanted:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[_Server, str]]:
    """A loopback HTTP server with Range support over a folder; (server, base URL)."""
    root = tmp_path_factory.mktemp("served")
    server = _Server(root)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def put_memory(root: str, local: Path) -> str:
    """Copy a local file or folder into ``memory://<root>/``; its URL."""
    fs = fsspec.filesystem("memory")
    target = f"{root}/{local.name}"
    if local.is_dir():
        for file in sorted(local.rglob("*")):
            if file.is_file():
                fs.pipe(f"{target}/{file.relative_to(local).as_posix()}", file.read_bytes())
    else:
        fs.pipe(target, local.read_bytes())
    return f"memory://{target}"


def put_http(server: _Server, base: str, local: Path) -> str:
    """Copy a local file or folder under the server's root; its URL."""
    folder = server.root / uuid.uuid4().hex[:8]
    folder.mkdir()
    if local.is_dir():
        shutil.copytree(local, folder / local.name)
    else:
        shutil.copy(local, folder / local.name)
    return f"{base}/{folder.name}/{local.name}"


# ---------------------------------------------------------------------------------------------
# inputs of every format (local files; each test puts them where it reads them)


def _sharded_bin(folder: Path) -> Path:
    folder.mkdir(parents=True)
    weight_map = {}
    torch.manual_seed(0)
    shards = [{"a.weight": torch.randn(8, 4), "a.bias": torch.zeros(8)},
              {"b.weight": torch.randn(4, 4).t()}]
    for number, shard in enumerate(shards):
        name = f"pytorch_model-{number + 1:05d}-of-00002.bin"
        torch.save(shard, folder / name, _use_new_zipfile_serialization=number == 0)  # zip, then legacy
        weight_map.update({key: name for key in shard})
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def _dcp(folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    dcp.save({"model": {"w": torch.randn(16, 8), "b": torch.arange(8.0)}, "epoch": 2}, checkpoint_id=folder)
    return folder


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("made")
    return {"bin-sharded": _sharded_bin(where / "binrepo"), "dcp": _dcp(where / "dcpckpt")}


FORMATS = {  # id -> (local input, which part of it is the input)
    "pt-zip": "single_lenet.pt",
    "pt-ddp": "ddp_lenet_wrapped.pt",
    "pt-legacy": "legacy_mlp.pt",
    "safetensors": "mlp.safetensors",
    "sharded-folder": "sharded",
    "sharded-index": "sharded/model.safetensors.index.json",
    "bin-sharded": "",
    "bin-index": "pytorch_model.bin.index.json",
    "dcp": "",
}


def local_input(kind: str, made: dict[str, Path]) -> tuple[Path, Path]:
    """(what is uploaded, the input inside it)."""
    if kind == "bin-sharded":
        return made["bin-sharded"], made["bin-sharded"]
    if kind == "bin-index":
        return made["bin-sharded"], made["bin-sharded"] / FORMATS[kind]
    if kind == "dcp":
        return made["dcp"], made["dcp"]
    if kind == "sharded-index":
        return FIXTURES / "sharded", FIXTURES / FORMATS[kind]
    return FIXTURES / FORMATS[kind], FIXTURES / FORMATS[kind]


def remote_input(kind: str, made: dict[str, Path], root: str) -> tuple[Path, str]:
    uploaded, local = local_input(kind, made)
    url = put_memory(root, uploaded)
    if local != uploaded:
        url += "/" + local.relative_to(uploaded).as_posix()
    return local, url


def fingerprint(path: Path | str) -> str:
    return ckptool.inspect(path, fingerprint=True).fingerprint


SUMMARY_FIELDS = ("format", "layout", "prefix", "tensors", "parameters", "bytes", "dtypes", "saved_devices", "tied",
                  "entries", "globals", "file_bytes", "metadata", "module_class", "fingerprint")


# ---------------------------------------------------------------------------------------------
# every command, every format, on memory://


@pytest.mark.parametrize("kind", list(FORMATS))
def test_inspect_and_scan_of_a_url_say_what_they_say_of_the_file(kind: str, made, memory: str) -> None:
    local, url = remote_input(kind, made, memory)
    code_l, out_l, _ = cli("inspect", local, "--json", "--fingerprint")
    code_r, out_r, err_r = cli("inspect", url, "--json", "--fingerprint")
    assert code_l == code_r == 0, err_r
    mine, theirs = json.loads(out_l), json.loads(out_r)
    assert {k: mine.get(k) for k in SUMMARY_FIELDS} == {k: theirs.get(k) for k in SUMMARY_FIELDS}
    assert theirs["path"] == url and "io" not in mine
    assert theirs["io"]["requests"] > 0 and theirs["io"]["bytes_read"] > 0
    code_l, out_l, _ = cli("scan", local, "--json")
    code_r, out_r, err_r = cli("scan", url, "--json")
    assert code_l == code_r, err_r
    mine, theirs = json.loads(out_l), json.loads(out_r)
    for key in ("format", "verdict", "globals", "opcodes", "unsafe"):
        assert mine[key] == theirs[key], key
    assert [label.replace(str(local.parent), "") for label in mine["pickles"]] == \
        [label.replace(url.rsplit("/", 1)[0], "") for label in theirs["pickles"]]
    assert "io" in theirs


def _same_write(command: list[str], local: Path, url: str, tmp_path: Path, suffix: str) -> None:
    """``command`` on the local input and on the URL: the same exit, and outputs holding the same weights."""
    out_l, out_r = tmp_path / f"local{suffix}", tmp_path / f"remote{suffix}"
    code_l, _, err_l = cli(command[0], local, *command[1:], "-o", out_l)
    code_r, stdout, err_r = cli(command[0], url, *command[1:], "-o", out_r, "--json")
    assert code_l == code_r, (err_l, err_r)
    if code_l == 0:
        assert fingerprint(out_l) == fingerprint(out_r)
        assert json.loads(stdout)["io"]["bytes_read"] > 0
    else:  # the same refusal, naming the URL where it named the file
        assert err_r.count("\n") == 1 and url in err_r
        assert err_r.replace(url, "IN").replace(str(out_r), "OUT") == err_l.replace(str(local), "IN").replace(
            str(out_l), "OUT")


@pytest.mark.parametrize("kind", list(FORMATS))
@pytest.mark.parametrize("command", [["convert"], ["convert", "--to", "pt"], ["strip"], ["add-prefix"],
                                     ["remap", "--to", "cpu"]], ids=["convert-st", "convert-pt", "strip",
                                                                     "add-prefix", "remap"])
def test_rewrites_of_a_url_write_what_the_file_writes(kind: str, command: list[str], made, memory: str,
                                                      tmp_path: Path) -> None:
    local, url = remote_input(kind, made, memory)
    suffix = ".safetensors" if command == ["convert"] else ".pt"
    _same_write(command, local, url, tmp_path, suffix)


@pytest.mark.parametrize("kind", list(FORMATS))
def test_diff_and_verify_of_a_url_against_the_file(kind: str, made, memory: str) -> None:
    local, url = remote_input(kind, made, memory)
    code, out, err = cli("diff", local, url, "--json")
    assert code == 0, err
    assert json.loads(out)["identical"] is True
    code, out, err = cli("verify", url, "--against", local, "--devices", "cpu", "--json")
    assert code == 0, err
    code, out, err = cli("verify", local, "--against", url, "--devices", "cpu", "--json")
    assert code == 0, err
    assert json.loads(out)["io"]["bytes_read"] > 0


def test_the_python_api_reads_urls(made, memory: str) -> None:
    local, url = remote_input("pt-zip", made, memory)
    checkpoint = ckptool.load(url, storage_options={})
    assert str(checkpoint.path) == url and checkpoint.format == "torch-zip"
    assert ckptool.inspect(url).tensors == ckptool.inspect(local).tensors
    assert ckptool.scan(url).safe
    assert ckptool.diff(url, local).identical
    assert ckptool.verify(url, against=local, devices="cpu").ok
    from ckptool.ops.load_into import to_state_dict

    got, want = to_state_dict(checkpoint.state_dict), torch.load(local, weights_only=True)["model"] \
        if "model" in torch.load(local, weights_only=True) else torch.load(local, weights_only=True)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


def _no_signature(data: bytearray, at: int) -> str:
    data[at:at + 4] = b"XXXX"
    return "has no local header"


def _reaching_into_the_next(data: bytearray, at: int) -> str:
    extra = int.from_bytes(data[at + 28:at + 30], "little")
    data[at + 28:at + 30] = (extra + 100).to_bytes(2, "little")  # its bytes now start 100 later
    return "overlap — refusing a zip bomb"


@pytest.mark.parametrize("corrupt", [_no_signature, _reaching_into_the_next])
def test_a_lazily_placed_zip_member_is_still_checked(corrupt, memory: str, tmp_path: Path) -> None:
    """A remote .pt's storages are placed when first read; a local header that lies is refused then,
    with the message a local file gets at once."""
    path = tmp_path / "bad.pt"
    torch.save({"w": torch.arange(4096.0)}, path)
    data = bytearray(path.read_bytes())
    at = data.index(b"bad/data/0") - 30  # the storage's local header (its name follows the 30 fixed bytes)
    assert data[at:at + 4] == b"PK\x03\x04"
    said = corrupt(data, at)
    path.write_bytes(bytes(data))
    code, _, local_err = cli("convert", path, "-o", tmp_path / "l.safetensors")
    url = put_memory(memory, path)
    code_r, _, remote_err = cli("inspect", url)  # places nothing: the header is never read
    assert code_r == 0
    code_r, _, remote_err = cli("convert", url, "-o", tmp_path / "r.safetensors")
    assert code == code_r == 3
    assert said in local_err and remote_err.replace(url, "IN") == local_err.replace(str(path), "IN")
    assert not (tmp_path / "r.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# failures


def test_a_missing_url_is_one_line_404(memory: str) -> None:
    code, out, err = cli("inspect", f"memory://{memory}/nothing.pt")
    assert code == 3 and err.count("\n") == 1
    assert "404" in err and f"memory://{memory}/nothing.pt" in err and "Traceback" not in err


def test_a_missing_shard_is_named(memory: str, tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    shutil.copytree(FIXTURES / "sharded", folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    url = put_memory(memory, folder)
    code, _, err = cli("inspect", url)
    assert code == 3 and err.count("\n") == 1
    assert "model-00002-of-00002.safetensors" in err and "missing" in err


def test_a_shard_named_outside_the_folder_is_refused(memory: str, tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    shutil.copytree(FIXTURES / "sharded", folder)
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {key: "../elsewhere.safetensors" for key in data["weight_map"]}
    index.write_text(json.dumps(data))
    url = put_memory(memory, folder)
    code, _, err = cli("inspect", url + "/model.safetensors.index.json")
    assert code == 3 and "refused" in err


def test_a_safetensors_header_over_the_limit_is_refused_before_it_is_fetched(http, tmp_path: Path) -> None:
    import struct

    from ckptool.formats.safetensors import MAX_HEADER_BYTES

    server, base = http
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES * 64) + b"{" + b" " * (1 << 20))
    url = put_http(server, base, path)
    server.reset()
    code, _, err = cli("inspect", url)
    assert code == 3 and "limit" in err and err.count("\n") == 1
    assert server.bytes_sent < MAX_HEADER_BYTES


def test_storage_option_must_be_key_value(memory: str) -> None:
    code, _, err = cli("inspect", f"memory://{memory}/x.pt", "--storage-option", "novalue")
    assert code == 2 and "KEY=VALUE" in err


def test_without_fsspec_a_url_names_the_extra(tmp_path: Path) -> None:
    """The core install has neither obstore nor fsspec: a URL is one line naming the extra, exit 3; a local file
    still reads."""
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['fsspec'] = sys.modules['obstore'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)])}
    run = subprocess.run([sys.executable, "-m", "ckptool", "inspect", "s3://bucket/model.pt"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stderr
    assert run.stderr.count("\n") == 1 and "pip install 'ckptool[remote]'" in run.stderr
    assert "Traceback" not in run.stderr
    run = subprocess.run([sys.executable, "-m", "ckptool", "inspect", str(FIXTURES / "mlp.safetensors")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_credentials_in_a_url_are_never_printed(http) -> None:
    server, base = http
    secret = base.replace("http://", "http://user:hunter2@") + "/nothing.pt?X-Amz-Signature=topsecret"
    code, out, err = cli("inspect", secret, "--json")
    assert code == 3
    assert "hunter2" not in err + out and "topsecret" not in err + out


# ---------------------------------------------------------------------------------------------
# over HTTP: the same results, and what it costs


@pytest.mark.parametrize("kind", ["pt-zip", "pt-legacy", "safetensors", "sharded-index"])
def test_http_inputs_read_as_local_files(kind: str, http, made, tmp_path: Path) -> None:
    server, base = http
    uploaded, local = local_input(kind, made)
    url = put_http(server, base, uploaded)
    if local != uploaded:
        url += "/" + local.relative_to(uploaded).as_posix()
    assert fingerprint(url) == fingerprint(local)
    code, out, err = cli("diff", url, local)
    assert code == 0, err
    code, _, err = cli("convert", url, "-o", tmp_path / "out.safetensors")
    assert code == 0, err
    assert fingerprint(tmp_path / "out.safetensors") == fingerprint(local)


def test_a_missing_http_file_is_404(http) -> None:
    server, base = http
    code, _, err = cli("scan", f"{base}/nowhere/model.pt")
    assert code == 3 and "404" in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def big_pt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~64 MiB .pt of a few big tensors (and a few small ones), as torch.save writes it."""
    path = tmp_path_factory.mktemp("big") / "big.pt"
    generator = torch.Generator().manual_seed(0)
    weights = {f"layers.{i}.weight": torch.randn(2048, 2048, generator=generator) for i in range(4)}
    weights.update({f"layers.{i}.bias": torch.zeros(2048) for i in range(4)})
    torch.save({"model": weights, "epoch": 7}, path)
    return path


def test_inspect_of_a_big_pt_over_http_reads_the_directory_and_pickle_only(http, big_pt: Path) -> None:
    server, base = http
    url = put_http(server, base, big_pt)
    assert big_pt.stat().st_size > 60 << 20
    server.reset()
    code, out, err = cli("inspect", url, "--json")
    assert code == 0, err
    io = json.loads(out)["io"]
    assert io["bytes_read"] < 2 << 20 and io["requests"] <= 6
    assert server.bytes_sent < 2 << 20 and server.requests <= 6  # counted where they are served too
    assert io["bytes_read"] == server.bytes_sent
    summary = json.loads(out)
    assert summary["tensors"] == 8 and summary["file_bytes"] == big_pt.stat().st_size


def test_scan_of_a_big_pt_over_http_reads_only_the_pickles(http, big_pt: Path) -> None:
    server, base = http
    url = put_http(server, base, big_pt)
    server.reset()
    code, out, err = cli("scan", url, "--json")
    assert code == 0, err
    assert json.loads(out)["verdict"] == "safe"
    assert server.bytes_sent < 2 << 20


def test_convert_of_a_big_pt_over_http_streams_every_byte_once(http, big_pt: Path, tmp_path: Path) -> None:
    server, base = http
    url = put_http(server, base, big_pt)
    server.reset()
    code, out, err = cli("convert", url, "-o", tmp_path / "big.safetensors", "--json")
    assert code == 0, err
    size = big_pt.stat().st_size
    assert size <= server.bytes_sent < size + (4 << 20)  # the tensors once, plus the directory and pickle
    assert fingerprint(tmp_path / "big.safetensors") == fingerprint(big_pt)


@pytest.mark.parametrize("name", ["../outside.distcp", "./../outside.distcp", "sub/../../outside.distcp"])
def test_a_remote_folder_member_may_not_step_out_of_it(name: str) -> None:
    from ckptool.files import inputs
    from ckptool.base.errors import InputError
    from ckptool.files.remote import RemotePath

    folder = RemotePath("memory://bucket/ckpt")
    with pytest.raises(InputError, match="outside the folder"):
        inputs.check_member(folder, folder / name, what="DCP data file", report=folder)


def test_an_index_over_the_limit_is_refused_by_its_size_alone(http, tmp_path: Path) -> None:
    from ckptool.formats.safetensors import MAX_HEADER_BYTES

    server, base = http
    folder = tmp_path / "repo"
    folder.mkdir()
    index = folder / "model.safetensors.index.json"
    with index.open("wb") as handle:  # sparse: claims more than any real index
        handle.write(b'{"weight_map": {}}')
        handle.truncate(MAX_HEADER_BYTES + 10)
    url = put_http(server, base, folder) + "/model.safetensors.index.json"
    server.reset()
    code, _, err = cli("inspect", url)
    assert code == 3 and "larger than any real index" in err and err.count("\n") == 1
    assert server.bytes_sent < 1 << 20


def test_local_commands_never_import_the_remote_layer() -> None:
    """A local path costs nothing for URLs: ckptool.files.remote (and fsspec) stay unimported."""
    code = ("import sys\nfrom click.testing import CliRunner\nfrom ckptool.cli.main import main\n"
            f"for args in (['inspect', {str(FIXTURES / 'single_lenet.pt')!r}, '--fingerprint'],\n"
            f"             ['scan', {str(FIXTURES / 'legacy_mlp.pt')!r}],\n"
            f"             ['diff', {str(FIXTURES / 'mlp.safetensors')!r}, {str(FIXTURES / 'sharded')!r}]):\n"
            "    result = CliRunner().invoke(main, args)\n"
            "    assert result.exit_code in (0, 1), result.output\n"
            "assert 'ckptool.files.remote' not in sys.modules and 'fsspec' not in sys.modules\n")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_inspect_of_a_big_safetensors_over_http_reads_its_header_only(http, big_pt: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    server, base = http
    path = tmp_path / "big.safetensors"
    save_file(torch.load(big_pt, weights_only=True)["model"], path)
    url = put_http(server, base, path)
    server.reset()
    code, out, err = cli("inspect", url, "--json")
    assert code == 0, err
    io = json.loads(out)["io"]
    assert io["bytes_read"] < 2 << 20 and io["requests"] <= 6
    assert server.bytes_sent == io["bytes_read"] and server.requests <= 6


@pytest.mark.parametrize("args", [["convert", "-o", "out.safetensors"], ["convert", "-o", "shards/", "--max-shard-size",
                                                                          "100KB"],
                                  ["convert", "--out-dir", "many"], ["strip", "-o", "out.pt"]],
                         ids=["file", "folder", "out-dir", "strip"])
def test_a_url_input_replaces_an_existing_local_output_with_force(args: list[str], memory: str,
                                                                   tmp_path: Path) -> None:
    """The checks that an output is not the input compare local files only: a URL input beside an
    existing local output is refused without --force and replaced with it (never an internal error)."""
    url = put_memory(memory, FIXTURES / "ddp_lenet_wrapped.pt")
    command, *rest = args
    rest = [str(tmp_path / a) if a.startswith(("out", "shards", "many")) else a for a in rest]
    (tmp_path / "many").mkdir()
    first = cli(command, url, *rest)
    assert first[0] == 0, first[2]
    again = cli(command, url, *rest)
    assert again[0] == 3 and "--force" in again[2] and "internal error" not in again[2], again[2]
    forced = cli(command, url, *rest, "--force")
    assert forced[0] == 0, forced[2]
