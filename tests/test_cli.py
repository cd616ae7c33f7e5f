"""The CLI: exit codes, one-line errors, --json, help text, and the README tour."""

from __future__ import annotations

import fractions
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptool.cli.main import main

REPO = Path(__file__).resolve().parent.parent


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_every_command_has_help_and_is_in_the_readme() -> None:
    readme = (REPO / "README.md").read_text()
    for name, command in main.commands.items():
        assert command.help and "Example:" in command.help, name
        assert f"ckptool {name}" in readme, f"README does not show ckptool {name}"
        code, out, _ = run(name, "--help")
        assert code == 0 and "Usage:" in out


def test_version() -> None:
    code, out, _ = run("--version")
    assert code == 0 and re.search(r"ckptool, version \d+\.\d+", out)


def test_inspect_json_has_the_documented_keys(fixtures_dir: Path) -> None:
    code, out, _ = run("inspect", fixtures_dir / "ddp_lenet_wrapped.pt", "--json", "--fingerprint")
    assert code == 0
    data = json.loads(out)
    for key in ("format", "layout", "prefix", "tensors", "parameters", "bytes", "dtypes", "saved_devices", "tied",
                "entries", "globals", "fingerprint"):
        assert key in data, key
    assert data["prefix"] == "module." and data["layout"] == ["model"]


def test_inspect_text_names_problem_and_fix(fixtures_dir: Path) -> None:
    path = fixtures_dir / "gpu_cuda1_ddp_lenet.pt"
    code, out, _ = run("inspect", path)
    assert code == 0
    # a wrapper prefix and GPU tags: one command fixes both (two in turn would leave two half-fixed files)
    assert f"fix: ckptool strip {path} -o {fixtures_dir / 'gpu_cuda1_ddp_lenet.cpu.pt'} --to cpu\n" in out
    assert out.count("fix: ") == 1


def test_inspect_fix_commands_run_as_printed_from_another_folder(fixtures_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each suggested command, pasted into a shell where inspect ran, names the input and runs."""
    folder = tmp_path / "my models"
    folder.mkdir()
    shutil.copy(fixtures_dir / "gpu_cuda1_ddp_lenet.pt", folder / "gpu run.pt")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, out, _ = run("inspect", Path("..") / "my models" / "gpu run.pt")
    fixes = [line.split("fix: ", 1)[1] for line in out.splitlines() if line.strip().startswith("fix: ")]
    assert code == 0 and len(fixes) == 1, out  # the prefix and the GPU tags: one command fixes both
    for fix in fixes:
        argv = shlex.split(fix)
        assert argv[:1] == ["ckptool"] and Path(argv[2]).exists(), fix
        code, _, err = run(*argv[1:])
        assert code == 0, (fix, err)
        assert Path(argv[argv.index("-o") + 1]).exists()
    assert sorted(p.name for p in folder.iterdir()) == ["gpu run.cpu.pt", "gpu run.pt"]


def test_refusal_names_the_global_to_allow_as_a_shell_word(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The --allow-global a refusal suggests, pasted as printed, allows exactly the refused global."""
    import types

    torch = pytest.importorskip("torch")
    module = types.ModuleType("a b;c")
    # an object pickled as a call of the class (a class only referred to, never called, is read as data)
    module.d = type("d", (), {"__module__": "a b;c", "__qualname__": "d", "__reduce__": lambda self: (type(self), ())})
    monkeypatch.setitem(sys.modules, "a b;c", module)  # so that pickle can name the class
    odd = tmp_path / "odd.pt"
    torch.save({"w": torch.ones(2), "kind": module.d()}, odd)
    code, _, err = run("inspect", odd)
    assert code == 3 and "pickle imports a b;c.d" in err, err
    suggested = err.rsplit("allow it by name: ", 1)[1].rstrip(")\n")
    assert suggested == "--allow-global 'a b;c.d'"
    code, out, err = run("inspect", odd, *shlex.split(suggested), "--json")
    assert code == 0 and json.loads(out)["globals"] == ["a b;c.d", "collections.OrderedDict",
                                                          "torch.FloatStorage", "torch._utils._rebuild_tensor_v2"]


def test_library_refusals_name_options_as_the_caller_passes_them(fixtures_dir: Path, tmp_path: Path) -> None:
    """The API's error names keyword arguments; the CLI's line for the same error names flags."""
    import ckptool
    from ckptool.ops import rewrite as operations
    from ckptool.model.cast import cast_weights
    from ckptool.model.keys import strip_prefix
    from ckptool.base.suggest import flag

    taken = tmp_path / "taken.pt"
    taken.write_bytes(b"keep me")
    refusals = []
    for call in (lambda: ckptool.save(ckptool.load(fixtures_dir / "ddp_lenet_wrapped.pt"), taken),
                 lambda: operations.strip(fixtures_dir / "ddp_lenet_wrapped.pt"),
                 lambda: operations.plan_convert([fixtures_dir / "single_lenet.pt"]),
                 lambda: operations.plan_convert([taken, taken], out=tmp_path / "x.pt"),
                 lambda: strip_prefix({"w": 1}, ""),
                 lambda: cast_weights(ckptool.load(fixtures_dir / "single_lenet.pt"), "bf17")):
        with pytest.raises(ckptool.CkptError) as raised:
            call()
        refusals.append(raised.value)
    deque = tmp_path / "deque.pt"
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.ones(1), "c": fractions.Fraction(1, 3)}, deque)
    with pytest.raises(ckptool.UnsafeCheckpointError) as raised:
        ckptool.load(deque)
    refusals.append(raised.value)
    for error in refusals:
        assert not re.search(r"(^|\s)--?[a-z]", str(error)), str(error)
    assert [error.render(flag).removeprefix(f"{error.path}: ") for error in refusals] == [
        "already exists — pass --force to overwrite it, or choose another -o",
        "missing -o OUT (or --in-place to rewrite the input)",
        "give exactly one of -o OUT (one input) or --out-dir DIR (any number of inputs)",
        "-o takes one input; use --out-dir DIR to convert several",
        "the prefix to strip is empty — pass --prefix, e.g. --prefix module.",
        "--dtype 'bf17': choose bf16, fp16 or fp32",
        "pickle imports fractions.Fraction, which could run code — refused, nothing was executed (if you trust this "
        "file, allow it by name: --allow-global fractions.Fraction)"]
    assert "pass force=True to overwrite it" in str(refusals[0])
    assert "allow_globals=['fractions.Fraction']" in str(refusals[-1])


def test_write_commands_report_one_json_shape(fixtures_dir: Path, tmp_path: Path) -> None:
    """strip, add-prefix and remap report the same fields; convert lists such reports, with -o as with --out-dir."""
    written = ["output", "format", "tensors", "bytes", "checked", "fingerprint", "files"]
    shapes = {
        ("strip", fixtures_dir / "ddp_lenet_wrapped.pt"): [*written, "notes", "input", "prefix", "renamed"],
        ("add-prefix", fixtures_dir / "single_lenet.pt"): [*written, "notes", "input", "prefix", "renamed"],
        ("remap", fixtures_dir / "gpu_cuda0_lenet.pt", "--to", "cpu"): [
            *written, "notes", "input", "devices_before", "devices_after"],
    }
    for number, (args, keys) in enumerate(shapes.items()):
        code, out, err = run(*args, "-o", tmp_path / f"{number}.pt", "--json")
        assert code == 0, err
        data = json.loads(out)
        assert data.pop("schema") == "ckptool.write/1" and list(data) == keys, args
    converted = ["input", *written, "aliases", "notes"]
    code, out, err = run("convert", fixtures_dir / "single_lenet.pt", "-o", tmp_path / "one.pt", "--json")
    data = json.loads(out)
    assert code == 0 and list(data) == ["schema", "converted", "failed"] and data["failed"] == []
    assert data["schema"] == "ckptool.convert/1" and list(data["converted"][0]) == converted
    code, out, _ = run("convert", fixtures_dir / "single_lenet.pt", tmp_path / "missing.pt", "--out-dir", tmp_path,
                       "--to", "pt", "--json")
    data = json.loads(out)
    assert code == 3 and list(data) == ["schema", "converted", "failed"] and list(data["converted"][0]) == converted
    [failure] = data["failed"]
    assert failure["type"] == "input" and failure["exit_code"] == 3 and failure["path"] == str(tmp_path / "missing.pt")
    assert "missing.pt" in failure["message"]


def test_exit_codes_are_listed_where_users_read_them() -> None:
    from ckptool.base import exitcodes

    codes = {name: value for name, value in vars(exitcodes).items() if name.isupper() and isinstance(value, int)}
    assert codes == {"OK": 0, "PROBLEM": 1, "USAGE": 2, "INPUT": 3, "INTERNAL": 70, "INTERRUPTED": 130,
                     "TERMINATED": 143, "CLOSED_PIPE": 141}
    _, help_text, _ = run("--help")
    readme = (REPO / "README.md").read_text()
    listed = readme[readme.index("exit codes are"):]
    listed = listed[:listed.index("as git does")]
    for name, code in codes.items():
        assert re.search(rf"(^|\D){code}(\D|$)", listed), f"README does not list exit code {code} ({name})"
    for code in exitcodes.HELP:
        assert re.search(rf"\b{code} [a-z]", " ".join(help_text.split())), f"--help does not list exit code {code}"


def test_scan_verdicts(fixtures_dir: Path, tmp_path: Path) -> None:
    code, out, _ = run("scan", fixtures_dir / "single_lenet.pt", "--json")
    assert code == 0 and json.loads(out)["safe"] is True
    evil = tmp_path / "evil.pkl"
    # protocol 0: GLOBAL posix system, then REDUCE — never executed, only read
    evil.write_bytes(b"cposix\nsystem\n(S'touch " + str(tmp_path / "CANARY").encode() + b"'\ntR.")
    code, out, _ = run("scan", evil, "--json")
    assert code == 1
    assert json.loads(out)["unsafe"] == ["posix.system"]
    code, _, err = run("inspect", evil)
    assert code == 3 and "posix.system" in err and err.count("\n") == 1
    assert not (tmp_path / "CANARY").exists()


def test_strip_cli_json_and_exit_codes(fixtures_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    code, stdout, _ = run("strip", fixtures_dir / "ddp_lenet_wrapped.pt", "-o", out, "--json", "--fingerprint")
    assert code == 0
    data = json.loads(stdout)
    assert data["prefix"] == "module." and data["renamed"] == 8 and data["fingerprint"].startswith("sha256:")
    code, _, err = run("strip", out, "-o", tmp_path / "again.pt")
    assert code == 1 and "nothing to strip" in err and not (tmp_path / "again.pt").exists()
    code, _, err = run("strip", fixtures_dir / "ddp_lenet_wrapped.pt", "-o", out)
    assert code == 3 and err == f"ckptool: error: {out}: already exists — pass --force to overwrite it, or choose another -o\n"


def test_in_place_strip(fixtures_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "ddp.pt"
    shutil.copy(fixtures_dir / "ddp_lenet_wrapped.pt", target)
    code, _, err = run("strip", target, "-o", target)
    assert code == 3 and "is the input" in err
    code, _, _ = run("strip", target, "--in-place")
    assert code == 0
    code, out, _ = run("inspect", target, "--json")
    assert json.loads(out)["prefix"] == ""


def test_remap_cli(fixtures_dir: Path, tmp_path: Path) -> None:
    code, stdout, _ = run("remap", fixtures_dir / "gpu_cuda1_ddp_lenet.pt", "-o", tmp_path / "c0.pt",
                          "--map", "cuda:1=cuda:0", "--json")
    assert code == 0
    data = json.loads(stdout)
    assert data["devices_before"] == {"cpu": 8, "cuda:1": 24} and data["devices_after"] == {"cpu": 8, "cuda:0": 24}
    code, _, err = run("remap", fixtures_dir / "gpu_cuda0_lenet.pt", "-o", tmp_path / "x.pt")
    assert code == 2 and "--to cpu" in err
    code, _, err = run("remap", fixtures_dir / "gpu_cuda0_lenet.pt", "-o", tmp_path / "x.pt", "--to", "gpu7")
    assert code == 2 and "not a device" in err


def test_convert_cli(fixtures_dir: Path, tmp_path: Path) -> None:
    code, stdout, _ = run("convert", fixtures_dir / "ddp_lenet_wrapped.pt", "-o", tmp_path / "m.safetensors",
                          "--strip", "--json")
    assert code == 0 and json.loads(stdout)["converted"][0]["format"] == "safetensors"
    code, stdout, _ = run("convert", fixtures_dir / "single_lenet.pt", fixtures_dir / "dp_mlp_wrapped.pt",
                          "--out-dir", tmp_path, "--json")
    assert code == 0 and len(json.loads(stdout)["converted"]) == 2
    assert (tmp_path / "single_lenet.safetensors").exists() and (tmp_path / "dp_mlp_wrapped.safetensors").exists()
    code, _, err = run("convert", fixtures_dir / "single_lenet.pt", "-o", tmp_path / "x.onnx")
    assert code == 2 and "cannot tell the format" in err
    code, _, err = run("convert", fixtures_dir / "single_lenet.pt", "-o", tmp_path / "s", "--max-shard-size", "lots")
    assert code == 2 and "500MB" in err


def test_torchscript_archives_give_their_weights(fixtures_dir: Path, tmp_path: Path) -> None:
    archive = fixtures_dir / "torchscript_mlp.pt"
    code, out, _ = run("inspect", archive)
    assert code == 0 and "torchscript" in out and "TorchScript archive of" in out
    code, out, _ = run("add-prefix", archive, "-o", tmp_path / "o.pt")
    assert code == 0 and "plain state-dict .pt" in out
    code, _, _ = run("convert", archive, "-o", tmp_path / "o.safetensors")
    assert code == 0 and (tmp_path / "o.safetensors").exists()


def test_out_dir_keeps_each_input_s_full_name(tmp_path: Path) -> None:
    # released checkpoints carry versions in their names: each must get its own output, named after it
    import torch

    sources = tmp_path / "in"
    sources.mkdir()
    for version in ("0.2.0", "0.3.0"):
        torch.save({"w": torch.full((2,), float(version[2]))}, sources / f"chgnet_{version}.pth.tar")
    torch.save({"w": torch.ones(1)}, sources / "run.v2.pt")
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, stderr = run("convert", *sorted(sources.iterdir()), "--out-dir", out)
    assert code == 0, stderr
    assert sorted(p.name for p in out.iterdir()) == ["chgnet_0.2.0.safetensors", "chgnet_0.3.0.safetensors",
                                                      "run.v2.safetensors"]
    wrapped = tmp_path / "ddp_run.v1.pth.tar"
    torch.save({"module.w": torch.ones(1)}, wrapped)
    code, stdout, _ = run("inspect", wrapped)
    assert code == 0 and f"-o {tmp_path / 'ddp_run.v1.stripped.pt'}" in stdout, stdout
    code, stdout, _ = run("diff", sources / "chgnet_0.2.0.pth.tar", out / "chgnet_0.2.0.safetensors")
    assert code == 0, stdout


def test_an_optimizer_file_says_it_is_optimizer_state(tmp_path: Path) -> None:
    """accelerate's optimizer.bin / transformers' optimizer.pt hold no model weights: inspect says what
    they hold (parameters, groups, per-parameter state) instead of only "no weights found"."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.1}])
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    path = tmp_path / "optimizer.bin"
    torch.save(optimizer.state_dict(), path)
    code, out, err = run("inspect", path)
    assert code == 0, err
    assert ("no model weights: this file is optimizer state: 4 params over 2 parameter groups, 12 tensors "
            "(Adam: step, exp_avg, exp_avg_sq)") in out
    assert f"fix: ckptool convert {path} -o {tmp_path / 'optimizer.safetensors'} --weights state" in out
    assert "no weights found" not in out
    container = tmp_path / "run.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, container)
    code, out, err = run("inspect", container)
    assert code == 0, err
    assert re.search(r"entry +optimizer: optimizer state: 4 params over 2 parameter groups, 12 tensors", out), out


def test_convert_refuses_an_output_name_no_format_claims_before_reading_the_input(tmp_path: Path) -> None:
    """The output's format is settled from its name first: an unreadable input is not even opened (a remote or
    26 GB one is not read) when the output name is the problem."""
    junk = tmp_path / "junk.pt"
    junk.write_bytes(bytes(range(256)) * 4)
    code, _, err = run("convert", str(junk), "-o", str(tmp_path / "out.xyz"))
    assert code == 2 and "cannot tell the format from 'out.xyz'" in err, err
    code, _, err = run("convert", str(junk), "-o", str(tmp_path / "out.safetensors"))
    assert code == 3 and "junk.pt" in err, err  # a name it can write: now the input is read, and refused
    assert sorted(path.name for path in tmp_path.iterdir()) == ["junk.pt"]
