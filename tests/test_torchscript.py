"""TorchScript archives: their parameters and buffers, exactly as torch.jit.load(f).state_dict() gives them,
read without running (or importing) anything; every command accepts them; their code stays unrun."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import ckptool
from ckptool.cli.main import main
from ckptool.ops.load_into import to_state_dict

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 3, 3, bias=False)
        self.bn = torch.nn.BatchNorm1d(3)
        self.register_buffer("scratch", torch.full((2,), 7.0), persistent=False)
        self.register_buffer("steps", torch.tensor([3, 1], dtype=torch.int64))
        self.scale = 0.5  # a plain attribute: in no state_dict
        self.table = torch.arange(4.0)  # a tensor attribute that is neither parameter nor buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) * self.scale + self.scratch.sum() + self.steps.sum() + self.table.sum()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.randn(3))
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4, 5), torch.nn.ReLU())
        self.tail = torch.nn.Linear(5, 5)
        self.register_buffer("offset", torch.randn(5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, 2, 6)
        mixed = (self.blocks[0](x) + self.blocks[1](x)) * self.gain[None, :, None]
        return self.tail(self.head(mixed)) + self.offset.float()


class Tied(torch.nn.Module):
    """Two Linear layers sharing one weight (weight tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _trained(module: torch.nn.Module, example: torch.Tensor) -> torch.nn.Module:
    module.train()
    with torch.no_grad():
        module(example)  # BatchNorm's running stats and num_batches_tracked move off their defaults
    return module.eval()


def _archives(tmp_path: Path) -> dict[str, Path]:
    torch.manual_seed(0)
    example = torch.randn(2, 2, 6)
    net = _trained(Net(), example)
    tied = Tied().eval()
    made = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, build in (("scripted", lambda: torch.jit.script(net)),
                            ("traced", lambda: torch.jit.trace(net, example)),
                            ("tied_scripted", lambda: torch.jit.script(tied)),
                            ("linear_traced", lambda: torch.jit.trace(torch.nn.Linear(3, 2, bias=False),
                                                                      torch.randn(1, 3)))):
            path = tmp_path / f"{name}.pt"
            build().save(str(path))
            made[name] = path
    return made


def _reference(path: Path) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dict(torch.jit.load(str(path), map_location="cpu").state_dict())


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)  # same keys, same order
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(got[key], tensor), key


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _archives(tmp_path_factory.mktemp("torchscript"))


@pytest.mark.parametrize("name", ["scripted", "traced", "tied_scripted", "linear_traced"])
def test_weights_are_what_torch_jit_load_state_dict_gives(archives: dict[str, Path], name: str) -> None:
    path = archives[name]
    checkpoint = ckptool.load(path)
    assert checkpoint.format == "torchscript"
    reference = _reference(path)
    _assert_same(to_state_dict(checkpoint.tensors), reference)
    assert all(not tensor.requires_grad for tensor in checkpoint.tensors.values())


def test_parameters_buffers_and_what_is_left_out(archives: dict[str, Path]) -> None:
    tensors = ckptool.load(archives["scripted"]).tensors
    # a non-persistent buffer is a buffer to a loaded archive (torch.jit.load lists it); plain tensor
    # attributes, Python values and the code's constants are in no state_dict
    assert "blocks.0.scratch" in tensors and "blocks.0.steps" in tensors
    assert "blocks.0.bn.num_batches_tracked" in tensors
    assert not any(key.endswith(("table", "scale")) for key in tensors)
    assert list(tensors)[:2] == ["gain", "offset"]  # a module's parameters, its buffers, then its children


def test_tied_weights_stay_tied(archives: dict[str, Path]) -> None:
    checkpoint = ckptool.load(archives["tied_scripted"])
    assert checkpoint.tensors["a.weight"].storage is checkpoint.tensors["b.weight"].storage
    summary = ckptool.inspect(archives["tied_scripted"])
    assert summary.tied == [["a.weight", "b.weight"]]


def test_the_committed_fixture_reads_as_torch_jit_load_gives_it(fixtures_dir: Path) -> None:
    path = fixtures_dir / "torchscript_mlp.pt"
    _assert_same(to_state_dict(ckptool.load(path).tensors), _reference(path))


def test_inspect_says_torchscript_and_what_it_read(archives: dict[str, Path]) -> None:
    code, out = _cli("inspect", archives["scripted"])
    assert code == 0
    assert "torchscript" in out and "TorchScript archive of test_torchscript.Net:" in out
    # Net: gain, 2 x (conv.weight, bn.weight, bn.bias), head.1.weight/bias, tail.weight/bias
    assert "11 parameters and 11 buffers" in out
    summary = json.loads(_cli("inspect", archives["scripted"], "--json")[1])
    assert summary["format"] == "torchscript" and summary["tensors"] == 22


def test_inspect_and_scan_import_no_torch(archives: dict[str, Path]) -> None:
    code = ("import sys, ckptool; ckptool.inspect(sys.argv[1]); ckptool.scan(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code, str(archives["traced"])], check=True)


@pytest.mark.parametrize("name", ["scripted", "traced"])
def test_convert_writes_the_weights(archives: dict[str, Path], name: str, tmp_path: Path) -> None:
    path = archives[name]
    reference = _reference(path)
    code, _ = _cli("convert", path, "-o", tmp_path / "w.safetensors")
    assert code == 0
    written = load_file(tmp_path / "w.safetensors")
    assert sorted(written) == sorted(reference)
    assert all(torch.equal(written[key], tensor) for key, tensor in reference.items())
    code, _ = _cli("convert", path, "-o", tmp_path / "w.pt")
    assert code == 0
    _assert_same(torch.load(tmp_path / "w.pt", weights_only=True), reference)
    code, _ = _cli("convert", path, "-o", tmp_path / "shards", "--max-shard-size", "200B")
    assert code == 0 and (tmp_path / "shards" / "model.safetensors.index.json").exists()


def test_a_rewrite_writes_a_plain_state_dict_and_says_so(archives: dict[str, Path], tmp_path: Path) -> None:
    path = archives["scripted"]
    code, out = _cli("add-prefix", path, "-o", tmp_path / "prefixed.pt")
    assert code == 0 and "plain state-dict .pt" in out
    written = torch.load(tmp_path / "prefixed.pt", weights_only=True)  # no __torch__ class left in it
    reference = _reference(path)
    assert list(written) == ["module." + key for key in reference]
    assert all(torch.equal(written["module." + key], tensor) for key, tensor in reference.items())
    with zipfile.ZipFile(tmp_path / "prefixed.pt") as archive:
        assert not any("/code/" in name or name.endswith("constants.pkl") for name in archive.namelist())


def test_verify_diff_and_load_into_accept_it(archives: dict[str, Path], tmp_path: Path) -> None:
    path = archives["scripted"]
    code, _ = _cli("convert", path, "-o", tmp_path / "w.safetensors")
    assert code == 0
    code, out = _cli("diff", path, tmp_path / "w.safetensors")
    assert code == 0 and "identical" in out
    code, _ = _cli("verify", path, "--against", tmp_path / "w.safetensors")
    assert code == 0
    torch.manual_seed(1)
    model = Tied()
    ckptool.load_into(model, archives["tied_scripted"])
    reference = _reference(archives["tied_scripted"])
    assert all(torch.equal(model.state_dict()[key], tensor) for key, tensor in reference.items())
    # the archive lists its non-persistent buffers (torch.jit.load does): a strict load into the eager
    # model refuses them, as model.load_state_dict(torch.jit.load(f).state_dict()) does
    with pytest.raises(ckptool.base.errors.CkptError, match="blocks.0.scratch"):
        ckptool.load_into(Net(), path)
    with pytest.raises(RuntimeError, match="blocks.0.scratch"):
        Net().load_state_dict(reference := _reference(path))
    assert "blocks.0.scratch" in reference


def test_scan_still_reports_the_archive_s_classes(archives: dict[str, Path]) -> None:
    report = ckptool.scan(archives["scripted"])
    assert report.format == "torchscript" and not report.safe
    assert "__torch__.test_torchscript.Net" in report.unsafe  # torch.jit.load builds these classes and runs their code
    # and it names the code those classes carry (read as a listing, never run)
    assert any("TorchScript code in" in note and "code/__torch__" in note for note in report.problems)
    code, out = _cli("scan", archives["scripted"])
    assert code == 1 and "UNKNOWN (torchscript" in out and "note: TorchScript code in" in out
    assert report.verdict == "unknown" and "refuses" not in out  # ckptool reads the archive: the closing line says so


# --------------------------------------------------------------------------------------------
# archives that are not what they claim: refused in one line, nothing run


def _rewritten(source: Path, out: Path, change: dict[str, bytes]) -> Path:
    """``source`` with members replaced (by name's tail) or added, stored uncompressed as torch writes them."""
    with zipfile.ZipFile(source) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    top = next(iter(members)).split("/", 1)[0]
    for tail, data in change.items():
        members[f"{top}/{tail}"] = data
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return out


def _member(path: Path, tail: str) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(next(name for name in archive.namelist() if name.endswith("/" + tail)))


def _refused(path: Path, match: str) -> None:
    for command in (["inspect"], ["convert", "-o", str(path.parent / "never.safetensors")]):
        result = CliRunner().invoke(main, [command[0], str(path), *command[1:]])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 3 and len(lines) == 1 and match in lines[0], result.stderr
    assert not (path.parent / "never.safetensors").exists()


def test_a_class_restoring_its_state_with_code_is_refused(archives: dict[str, Path], tmp_path: Path) -> None:
    source = archives["linear_traced"]
    code_name = next(name for name in zipfile.ZipFile(source).namelist() if name.endswith(".py"))
    tail = code_name.split("/", 1)[1]
    text = _member(source, tail).decode() + "  def __setstate__(self, state: Tuple[Tensor]) -> NoneType:\n    return None\n"
    _refused(_rewritten(source, tmp_path / "setstate.pt", {tail: text.encode()}), "__setstate__")


def test_an_attribute_the_pickle_lacks_is_refused(archives: dict[str, Path], tmp_path: Path) -> None:
    source = archives["linear_traced"]
    code_name = next(name for name in zipfile.ZipFile(source).namelist() if name.endswith(".py"))
    tail = code_name.split("/", 1)[1]
    text = _member(source, tail).decode().replace("  weight : Tensor\n", "  weight : Tensor\n  ghost : Tensor\n")
    _refused(_rewritten(source, tmp_path / "ghost.pt", {tail: text.encode()}), "'ghost'")


def test_a_dangerous_global_in_the_module_pickle_is_refused(archives: dict[str, Path], tmp_path: Path) -> None:
    source = archives["linear_traced"]
    data = _member(source, "data.pkl")
    # the module's "training" flag becomes os.system("...") — a global outside the allowlist
    canary = tmp_path / "ran"
    payload = b"cos\nsystem\nX" + len(f"touch {canary}").to_bytes(4, "little") + f"touch {canary}".encode() + b"\x85R"
    flag = b"trainingq\n\x88"  # BINUNICODE "training", BINPUT 10, NEWTRUE (a traced module is in training mode)
    assert data.count(flag) == 1
    patched = _rewritten(source, tmp_path / "payload.pt", {"data.pkl": data.replace(flag, b"trainingq\n" + payload)})
    with pytest.raises(ckptool.UnsafeCheckpointError, match="os.system"):
        ckptool.load(patched)
    report = ckptool.scan(patched)
    assert not report.safe and "os.system" in report.unsafe
    assert not canary.exists()


def _cli(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout + result.stderr


def test_in_place_is_refused_and_the_archive_kept(archives: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(archives["scripted"].read_bytes())
    for args in (["add-prefix", path, "--in-place"], ["remap", path, "--to", "cpu", "--in-place"]):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 2 and "would replace the archive and its code" in result.stderr
        assert result.stderr.count("\n") == 1
    assert path.read_bytes() == archives["scripted"].read_bytes()


def test_an_attribute_declared_twice_is_refused(archives: dict[str, Path], tmp_path: Path) -> None:
    source = archives["linear_traced"]
    code_name = next(name for name in zipfile.ZipFile(source).namelist() if name.endswith(".py"))
    tail = code_name.split("/", 1)[1]
    text = _member(source, tail).decode().replace("  weight : Tensor\n", "  weight : Tensor\n  weight : Tensor\n")
    _refused(_rewritten(source, tmp_path / "twice.pt", {tail: text.encode()}), "'weight' twice")


def test_a_module_whose_class_is_not_declared_is_refused(archives: dict[str, Path], tmp_path: Path) -> None:
    # dropping it would silently lose the module's weights; torch cannot load the archive either
    source = archives["scripted"]
    with zipfile.ZipFile(source) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    path = tmp_path / "no_conv_code.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            if not name.endswith("/code/__torch__/torch/nn/modules/conv.py"):
                archive.writestr(name, data)
    with pytest.raises(Exception):
        _reference(path)
    _refused(path, "Conv1d is not declared in the archive's code/")


# ---------------------------------------------------------------------------------------------- bounded code reading


class Named(torch.nn.Module):
    """Parameters whose names the code must quote: a ParameterList's and a ParameterDict's keys."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        super().__init__()
        self.listed = torch.nn.ParameterList([torch.nn.Parameter(torch.full((2,), float(i))) for i in range(3)])
        self.named = torch.nn.ParameterDict({key: torch.nn.Parameter(torch.full((i + 1,), float(i)))
                                             for i, key in enumerate(keys)})
        self.register_buffer("steps", torch.arange(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.steps.sum()


def _scripted(module: torch.nn.Module, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(module.eval()).save(str(path))
    return path


def test_quoted_names_read_as_torch_jit_load_gives_them(tmp_path: Path) -> None:
    path = _scripted(Named(("a b", "é", "s'q", "x-y")), tmp_path / "named.pt")  # (torch writes names unescaped)
    _assert_same(to_state_dict(ckptool.load(path).tensors), _reference(path))


def test_a_name_torch_cannot_read_is_refused_as_torch_refuses_it(tmp_path: Path) -> None:
    path = _scripted(Named(("back\\slash",)), tmp_path / "backslash.pt")  # torch writes "back\slash" unescaped
    with pytest.raises(Exception, match="octal"):
        _reference(path)
    _refused(path, "not a string literal torch reads")


def test_a_scripted_resnet18_reads_as_torch_jit_load_gives_it(tmp_path: Path) -> None:
    torchvision = pytest.importorskip("torchvision")
    path = _scripted(torchvision.models.resnet18(), tmp_path / "resnet18.pt")
    _assert_same(to_state_dict(ckptool.load(path).tensors), _reference(path))


def _flooded(source: Path, out: Path, line: str) -> Path:
    """``source`` with its top class's ``__parameters__`` line replaced by ``line`` (stored: no zip bomb)."""
    tail = next(name for name in zipfile.ZipFile(source).namelist()
                if name.endswith(".py") and "__parameters__ = [" in _member(source, name.split("/", 1)[1]).decode())
    tail = tail.split("/", 1)[1]
    text = _member(source, tail).decode()
    start = text.index("  __parameters__ = [")
    end = text.index("\n", start)
    return _rewritten(source, out, {tail: (text[:start] + line + text[end:]).encode()})


# ~16 MiB lines of what a list of names must not hold, or holds too much of: each parsed whole as a Python literal
# once held 1.5-6 GB (numbers: 5.8 GB); each is refused in one line within the budget
FLOODS = {  # (the line, what the refusal names)
    "numbers": (lambda: "  __parameters__ = [" + "17," * (5 << 20) + "]", "MiB of text"),
    "numbers within the text budget": (lambda: "  __parameters__ = [" + "17," * (1 << 20) + "]",
                                       "not a list of names"),
    "names": (lambda: "  __parameters__ = [" + "".join(f'"n{i}",' for i in range(900_000)) + "]", "MiB of text"),
    "many names in little text": (lambda: "  __parameters__ = [" + '"x",' * 700_000 + "]", "over 100000"),
    "nested lists": (lambda: "  __parameters__ = " + "[" * 400_000 + "]" * 400_000, "not a list of names"),
    "a long name": (lambda: '  __parameters__ = ["' + "x" * (1 << 20) + '"]', "characters"),
}


@pytest.mark.parametrize("name", FLOODS)
def test_a_flood_in_a_list_of_names_is_refused_in_bounded_memory(archives: dict[str, Path], tmp_path: Path,
                                                                 name: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_bounds import GiB, one_error_line, run_limited

    line, refusal = FLOODS[name]
    path = _flooded(archives["linear_traced"], tmp_path / "flood.pt", line())
    completed = run_limited(["inspect", path], int(1.5 * GiB), tmp_path, timeout=300)
    assert completed.returncode == 3, completed.stderr[-2000:]
    message = one_error_line(completed.stderr, path)
    assert "TorchScript class" in message and refusal in message, message


def test_a_long_list_of_names_within_the_budget_reads(archives: dict[str, Path], tmp_path: Path) -> None:
    # 2000 declared parameters the module does not hold: the list is read, the weights are those it holds
    names = ", ".join(f'"p{i}"' for i in range(2000))
    path = _flooded(archives["linear_traced"], tmp_path / "listed.pt", f'  __parameters__ = ["weight", {names}, ]')
    _assert_same(to_state_dict(ckptool.load(path).tensors), _reference(archives["linear_traced"]))


def test_code_past_the_total_budget_is_refused(archives: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptool.formats import torchscript

    monkeypatch.setattr(torchscript, "MAX_CODE_TOTAL", 1000)  # a small archive stands for a large one
    _refused(archives["scripted"], "code files hold over 1000 B of text")
