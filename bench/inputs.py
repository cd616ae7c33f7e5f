"""The generated checkpoints ``python -m bench`` measures: sized ones, a many-tiny-tensor one, and their twins."""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .measure import GIB, MIB

GEN_VERSION = 1  # bump when the generated checkpoints change shape


GEN_SCRIPT = r'''
import json, os, sys, torch
path, twin, nbytes, n_small, n_tiny = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
n_many = int(sys.argv[6]) if len(sys.argv) > 6 else 0
g = torch.Generator().manual_seed(0)
sd = {}
if n_many:
    # an MoE-like state dict (DDP-wrapped: `module.` keys), small tensors of mixed shapes and dtypes:
    # per layer a router, norms, and experts of three projections each, until n_many tensors
    shapes = {"gate_proj.weight": (8, 8), "up_proj.weight": (8, 8), "down_proj.weight": (8, 8)}
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    i = 0
    layer = 0
    while len(sd) < n_many:
        pre = f"module.model.layers.{layer}"
        sd[f"{pre}.input_layernorm.weight"] = torch.randn(16, generator=g)
        sd[f"{pre}.post_attention_layernorm.weight"] = torch.randn(16, generator=g)
        sd[f"{pre}.mlp.gate.weight"] = torch.randn(16, 8, generator=g).to(torch.bfloat16)
        sd[f"{pre}.mlp.gate.e_score_correction_bias"] = torch.randn(16, generator=g)
        sd[f"{pre}.mlp.tokens_seen"] = torch.tensor(layer, dtype=torch.int64)
        for j in range(64):
            for name, shape in shapes.items():
                sd[f"{pre}.mlp.experts.{j}.{name}"] = torch.randn(*shape, generator=g).to(dtypes[i % 3])
                i += 1
        layer += 1
    sd = dict(list(sd.items())[:n_many])
elif n_tiny:
    # many tiny tensors: what inspect/scan cost per tensor, not per byte
    for i in range(n_tiny):
        sd[f"module.blocks.{i // 4}.p{i % 4}"] = torch.randn(16, generator=g)
else:
    widths = (64, 128, 256, 512, 768, 1024, 2048)
    used = 0
    for i in range(n_small):
        layer, kind = divmod(i, 4)
        if kind == 3:
            t = torch.tensor(i, dtype=torch.int64)  # like BatchNorm's num_batches_tracked
        else:
            t = torch.randn(widths[i % len(widths)], generator=g)
        sd[f"module.layers.{layer}.{('bias', 'norm.weight', 'norm.bias', 'num_batches_tracked')[kind]}"] = t
        used += t.numel() * t.element_size()
    n_large = 4
    rest = max(nbytes - used, n_large * 4096)
    cols = 4096
    for j in range(n_large):
        dtype = torch.float32 if j % 2 == 0 else torch.bfloat16
        esize = 4 if dtype == torch.float32 else 2
        rows = max(1, rest // n_large // esize // cols)
        sd[f"module.large.{j}.weight"] = torch.randn(rows, cols, generator=g, dtype=torch.float32).to(dtype)

# tag every storage 'cuda:0', exactly what torch.save writes on a GPU (see fixtures/make_fixtures.py)
registry = torch.serialization._package_registry
entry = (min(e[0] for e in registry) - 1, lambda storage: "cuda:0", lambda storage, location: None)
torch.serialization.register_package(*entry)
try:
    torch.save(sd, path + ".tmp")
    # the twin: the same weights saved in the reverse order -> different bytes, equal content
    torch.save(dict(reversed(list(sd.items()))), twin + ".tmp")
finally:
    registry.remove(entry)
for p in (path, twin):
    with open(p + ".tmp", "rb+") as f:
        os.fsync(f.fileno())
    os.replace(p + ".tmp", p)
print(json.dumps({"tensors": len(sd), "bytes": sum(t.numel() * t.element_size() for t in sd.values()),
                  "torch": torch.__version__}))
'''


@dataclass
class Input:
    label: str          # "0.25 GiB", "10k tiny", "100k tensors"
    nbytes: int         # requested tensor bytes (0 for the tiny one)
    path: Path
    twin: Path
    tensors: int = 0
    file_bytes: int = 0
    gen_s: float = 0.0
    reused: bool = False
    many: bool = False  # the --many-tensors input (per-tensor cost; goals of its own)


def parse_size(text: str) -> int:
    """'0.25' (GiB), '1G', '5M', '512MiB' -> bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = GIB
    if t.endswith("g"):
        t = t[:-1]
    elif t.endswith("m"):
        t, scale = t[:-1], MIB
    elif t.endswith("k"):
        t, scale = t[:-1], 1024
    value = int(float(t) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0: {text!r}")
    return value


def parse_sizes(text: str) -> list[int]:
    """A comma-separated ``--sizes`` list -> bytes each."""
    return [parse_size(s) for s in text.split(",") if s.strip()]


def size_label(nbytes: int) -> str:
    if nbytes >= GIB // 4:
        return f"{nbytes / GIB:g} GiB"
    return f"{nbytes / MIB:g} MiB"


def make_input(workdir: Path, python: str, *, nbytes: int = 0, n_tiny: int = 0, n_many: int = 0,
               log: Callable[[str], None]) -> Input:
    if n_many:
        label = f"{n_many // 1000}k tensors" if n_many >= 1000 else f"{n_many} tensors"
        stem, n_small = f"many-{n_many}", 0
    elif n_tiny:
        label, stem, n_small = f"{n_tiny // 1000}k tiny" if n_tiny >= 1000 else f"{n_tiny} tiny", f"tiny-{n_tiny}", 0
    else:
        # ~1000 small tensors, fewer when the size is too small to hold them (the smoke test's 5 MiB)
        label, stem, n_small = size_label(nbytes), f"ckpt-{nbytes}", min(1000, max(8, nbytes // (64 * 1024)))
    path = workdir / f"{stem}-v{GEN_VERSION}.pt"
    twin = workdir / f"{stem}-v{GEN_VERSION}-twin.pt"
    meta_path = workdir / f"{stem}-v{GEN_VERSION}.json"
    inp = Input(label, nbytes, path, twin, many=bool(n_many))
    if path.exists() and twin.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        inp.tensors, inp.reused = meta["tensors"], True
    else:
        log(f"generating {label} checkpoint + twin in {workdir} ...")
        t0 = time.perf_counter()
        out = subprocess.run([python, "-c", GEN_SCRIPT, str(path), str(twin), str(nbytes), str(n_small), str(n_tiny),
                              str(n_many)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"bench: generating {label} failed:\n{out.stderr[-3000:]}")
        meta = json.loads(out.stdout.strip().splitlines()[-1])
        meta_path.write_text(json.dumps(meta))
        inp.tensors, inp.gen_s = meta["tensors"], time.perf_counter() - t0
    inp.file_bytes = path.stat().st_size
    return inp
