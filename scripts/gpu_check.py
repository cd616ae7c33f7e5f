"""The checks that need a real GPU, in one run: ``python scripts/gpu_check.py OUT_DIR`` on a CUDA machine.

1. the tests that change with CUDA present (``tests/test_gpu.py``, the fixture and verify tests), to ``tests.log``;
2. real GPU-saved checkpoints for ``fixtures/gpu/`` (a single-process run on cuda:0, DataParallel, an nccl DDP run,
   a Lightning Trainer's default ``.ckpt`` where Lightning is installed), each described by torch itself in
   ``recorded.json``: every tensor's place in the object, location tag, dtype, shape and sha256;
3. verify's CPU/GPU parity for LeNet, the MLP and ResNet-18 trained on the GPU, to ``parity.json``.

``--steps`` picks some of ``tests,record,parity`` (all by default; the whole run takes ~5 minutes on an H200
machine, most of it the tests). Nothing here needs ckptool installed: it runs from the repository (``PYTHONPATH``
is set for the children), e.g. with the machine's own torch. On a CPU-only machine it runs too: the GPU tests
skip, the recording has no Lightning file and its tags are "cpu" (tests/test_gpu_recorded.py refuses such a
recording), and parity has the CPU row alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--epochs", "1", "--train-size", "512", "--test-size", "128"]
# the tests that run differently where torch sees a GPU (gpu-marked, CUDA-conditional, DataParallel on cuda:0,
# verify --devices all, training on cuda)
TESTS = ["tests/test_gpu.py", "tests/test_gpu_recorded.py", "tests/test_fixtures.py", "tests/test_verify.py",
         "tests/test_load_into.py", "tests/test_training.py", "tests/test_materialize.py", "tests/test_writer.py",
         "tests/test_salvage.py", "tests/test_torch_import.py"]
STEPS = ("tests", "record", "parity")


def load_keeping_tags(path: Path) -> tuple[Any, dict[int, str]]:
    """``torch.load(path, weights_only=True)`` (plus ``pathlib`` paths, which Lightning's hyper-parameters hold)
    with every storage left on the CPU, and each storage's saved location tag by its data pointer."""
    import torch

    tags: dict[int, str] = {}

    def keep_on_cpu(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        tags[storage.data_ptr()] = location
        return storage

    with torch.serialization.safe_globals([pathlib.PosixPath, pathlib.WindowsPath]):
        return torch.load(path, weights_only=True, map_location=keep_on_cpu), tags


def describe(path: Path) -> list[dict[str, Any]]:
    """Every tensor of ``path`` as torch reads it (:func:`load_keeping_tags`): place in the object, saved location
    tag, dtype, shape, sha256."""
    import torch

    obj, tags = load_keeping_tags(path)
    found: list[dict[str, Any]] = []

    def walk(node: object, place: list[str]) -> None:
        if isinstance(node, torch.Tensor):
            data = node.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if node.numel() else b""
            found.append({"path": place, "location": tags[node.untyped_storage().data_ptr()],
                          "dtype": str(node.dtype).removeprefix("torch."), "shape": list(node.shape),
                          "sha256": hashlib.sha256(data).hexdigest()})
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, [*place, str(key)])
        elif isinstance(node, (list, tuple)):
            for index, value in enumerate(node):
                walk(value, [*place, str(index)])

    walk(obj, [])
    return found


def run(command: list[str], log: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    output = completed.stdout + completed.stderr
    if log is not None:
        log.write_text(output)
    print(output[-3000:] if completed.returncode else output[-600:], flush=True)
    print(f"(exit {completed.returncode}, {time.perf_counter() - started:.1f} s)", flush=True)
    return completed


def lightning_ckpt(work: Path) -> Path | None:
    """A LightningModule trained for 2 epochs on cuda:0 by a Trainer; its default ModelCheckpoint's file."""
    script = f"""
import sys
sys.path.insert(0, {str(REPO / 'scripts' / 'frameworks')!r})
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import fw_lightning
L.seed_everything(0, workers=True)
model = fw_lightning.lightning_module_class()()
train, val = fw_lightning.data()
trainer = L.Trainer(accelerator="gpu", devices=1, max_epochs=2, default_root_dir={str(work)!r},
                    callbacks=[ModelCheckpoint()], logger=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(model, train, val)
"""
    if run([sys.executable, "-c", script], timeout=300).returncode != 0:
        return None
    found = sorted(work.rglob("*.ckpt"))
    return found[0] if len(found) == 1 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ckptool-gpu-check"),
                        help="for the runs' other files (ResNet-18 weights, logs), outside OUT")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"which of {', '.join(STEPS)} to run (default: all)")
    args = parser.parse_args()
    steps = set(args.steps.split(","))
    if not steps <= set(STEPS):
        parser.error(f"--steps: choose from {', '.join(STEPS)}")
    import torch

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    machine = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
               "devices": [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
               if cuda else []}
    print(json.dumps(machine), flush=True)

    if "tests" in steps:
        workers = str(max(2, min(len(TESTS), (os.cpu_count() or 2) // 2)))
        run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers, "--dist", "loadfile",
             *TESTS], log=out / "tests.log")

    if "record" in steps:
        record(out, work, machine, cuda)
    if "parity" in steps:
        parity(out, work, machine)
    return 0


def record(out: Path, work: Path, machine: dict[str, Any], cuda: bool) -> None:
    """The GPU-saved checkpoints and torch's description of each, into ``out``."""
    recorded: dict[str, Any] = {"machine": machine, "files": {}}
    training = [sys.executable, "-m", "training"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    runs = {  # name: (launcher, arguments, what it is)
        "single_lenet.pt": (training, ["--mode", "single", "--model", "lenet"], "full training state, on cuda:0"),
        "dp_mlp_wrapped.pt": (training, ["--mode", "dp", "--model", "mlp", "--save-style", "wrapped"],
                              "nn.DataParallel on the GPUs there are"),
        "ddp_nccl_lenet_wrapped.pt": (torchrun + ["-m", "training"], ["--mode", "ddp", "--model", "lenet",
                                                                     "--save-style", "wrapped"], "DDP on nccl"),
    }
    for name, (launcher, arguments, about) in runs.items():
        if run(launcher + arguments + SMALL + ["--out", str(out / name)]).returncode == 0:
            shown = ("torchrun --standalone --nproc-per-node 1 -m training" if launcher is not training
                     else "python -m training")
            recorded["files"][name] = {"made_by": f"{shown} {' '.join(arguments + SMALL)} ({about})"}
    if cuda:
        ckpt = lightning_ckpt(work / "lightning")
        if ckpt is not None:
            (out / "lightning_default.ckpt").write_bytes(ckpt.read_bytes())
            recorded["files"]["lightning_default.ckpt"] = {
                "made_by": "lightning.Trainer(accelerator='gpu', devices=1, max_epochs=2, callbacks=[ModelCheckpoint()])"
                           " fitting scripts/frameworks/fw_lightning.py's TinyClassifier"}
    for name, entry in recorded["files"].items():
        data = (out / name).read_bytes()
        entry["sha256"] = hashlib.sha256(data).hexdigest()
        entry["tensors"] = describe(out / name)
    (out / "recorded.json").write_text(json.dumps(recorded, indent=1) + "\n")


def parity(out: Path, work: Path, machine: dict[str, Any]) -> None:
    """verify --devices all on LeNet, the MLP and ResNet-18 trained on the GPU, and on fixtures/gpu/'s LeNet."""
    found: dict[str, Any] = {"machine": machine, "models": {}}
    runs = []
    for model in ("lenet", "mlp", "resnet18"):
        weights = work / f"{model}.pt"
        if run([sys.executable, "-m", "training", "--mode", "single", "--model", model, "--weights-only", *SMALL,
                "--out", str(weights)]).returncode == 0:
            runs.append((model, model, weights))
    runs.append(("fixtures/gpu/single_lenet.pt", "lenet", REPO / "fixtures" / "gpu" / "single_lenet.pt"))
    for label, model, weights in runs:
        started = time.perf_counter()
        # the models by import path: the training distribution's entry point (training:NAME) needs it installed
        completed = run([sys.executable, "-m", "ckptool", "verify", str(weights), "--model",
                         f"training.models:build_model?name={model}", "--devices", "all", "--input-shape", "64,1,28,28",
                         "--json"])
        seconds = time.perf_counter() - started
        try:
            verdict = json.loads(completed.stdout)
        except ValueError:
            verdict = {"unparsed": completed.stdout[-2000:]}
        found["models"][label] = {"exit": completed.returncode, "seconds": round(seconds, 2), "verify": verdict}
    (out / "parity.json").write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
