"""What ``python -m bench`` runs: the interpreter baselines, the disk (cat, cp, cp + sync), the naive torch
paths and ckptool's commands, each a whole process; and which ones a ``--tools`` list selects."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .inputs import Input
from .measure import GIB, REPO, child_env


NAIVE_SCRIPT = r'''
import sys, torch
src, dst, mmap, how = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
sd = torch.load(src, map_location="cpu", weights_only=True, mmap=mmap)
sd = {(k[len("module."):] if k.startswith("module.") else k): v for k, v in sd.items()}
if how == "safetensors-bf16":  # the reference for convert --dtype bf16
    sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
    how = "safetensors"
if how == "safetensors":
    from safetensors.torch import save_file
    save_file(sd, dst)
else:
    torch.save(sd, dst)
'''


@dataclass
class Ctx:
    python: str
    inp: Input | None
    out_dir: Path


@dataclass
class Tool:
    name: str
    group: str                         # baseline | disk | naive | ckptool
    argv: Callable[[Ctx], list[str]]
    job: str = ""                      # convert | rewrite | read | compare | startup
    per_size: bool = True              # False: run once per repetition, not per checkpoint
    writes: str = ""                   # output file name when the tool writes one
    reads_input: bool = True           # eligible for the cold-cache run
    cold: bool = True                  # run cold by default (else only with --full)
    max_bytes: int = 0                 # run only on inputs up to this size by default (0: any; --full: any)
    twin: bool = False                 # reads the twin too
    subcommand: str = ""               # ckptool subcommand that must exist
    needs_option: str = ""             # ... with this option in its --help
    ok_codes: tuple[int, ...] = (0,)
    description: str = ""


def _ckptool(ctx: Ctx, *args: str) -> list[str]:
    return [ctx.python, "-m", "ckptool", *args]


def _out(ctx: Ctx, name: str) -> str:
    return str(ctx.out_dir / name)


def _naive(mmap: bool, how: str) -> Callable[[Ctx], list[str]]:
    ext = "safetensors" if how.startswith("safetensors") else "pt"
    return lambda c: [c.python, "-c", NAIVE_SCRIPT, str(c.inp.path), _out(c, f"naive.{ext}"), "1" if mmap else "0", how]


TOOLS: list[Tool] = [
    # interpreter baselines (memory baselines and the start-up floor)
    Tool("python", "baseline", lambda c: [c.python, "-c", "pass"], job="startup", per_size=False, reads_input=False,
         description='python -c "pass"'),
    Tool("import-torch", "baseline", lambda c: [c.python, "-c", "import torch"], job="startup", per_size=False,
         reads_input=False, description='python -c "import torch"'),
    Tool("help", "ckptool", lambda c: _ckptool(c, "--help"), job="startup", per_size=False, reads_input=False,
         description="ckptool --help"),
    # the disk
    Tool("read", "disk", lambda c: ["cat", str(c.inp.path)], job="read", description="cat CKPT > /dev/null"),
    Tool("read-both", "disk", lambda c: ["cat", str(c.inp.path), str(c.inp.twin)], job="read", twin=True,
         description="cat A B > /dev/null (reference for diff / verify)"),
    Tool("cp", "disk", lambda c: ["cp", str(c.inp.path), _out(c, "cp.pt")], job="copy", writes="cp.pt",
         description="cp CKPT OUT"),
    Tool("cp+sync", "disk",
         lambda c: ["sh", "-c", 'cp "$1" "$2" && sync "$2" "$3"', "sh", str(c.inp.path), _out(c, "cpsync.pt"),
                    str(c.out_dir)],
         job="copy", writes="cpsync.pt", description="cp CKPT OUT && sync OUT OUTDIR (the durable-write limit)"),
    # the naive torch paths
    Tool("naive-st", "naive", _naive(False, "safetensors"), job="convert", writes="naive.safetensors", cold=False,
         description="torch.load + strip keys + safetensors save_file"),
    Tool("naive-st-mmap", "naive", _naive(True, "safetensors"), job="convert", writes="naive.safetensors",
         description="torch.load(mmap=True) + strip keys + save_file"),
    Tool("naive-st-bf16", "naive", _naive(False, "safetensors-bf16"), job="cast", writes="naive.safetensors",
         cold=False, description="torch.load + strip keys + .to(bfloat16) + save_file"),
    Tool("naive-pt", "naive", _naive(False, "torch"), job="rewrite", writes="naive.pt", cold=False,
         description="torch.load + strip keys + torch.save"),
    Tool("naive-pt-mmap", "naive", _naive(True, "torch"), job="rewrite", writes="naive.pt",
         description="torch.load(mmap=True) + strip keys + torch.save"),
    # ckptool
    Tool("convert", "ckptool", lambda c: _ckptool(c, "convert", str(c.inp.path), "-o", _out(c, "out.safetensors")),
         job="convert", writes="out.safetensors", subcommand="convert", description="ckptool convert CKPT -o OUT.safetensors"),
    Tool("convert-bf16", "ckptool",
         lambda c: _ckptool(c, "convert", str(c.inp.path), "-o", _out(c, "bf16.safetensors"), "--dtype", "bf16"),
         job="cast", writes="bf16.safetensors", subcommand="convert",
         description="ckptool convert CKPT -o OUT.safetensors --dtype bf16"),
    Tool("convert-shards", "ckptool",
         lambda c: _ckptool(c, "convert", str(c.inp.path), "-o", _out(c, "shards"), "--max-shard-size", "200MB"),
         job="convert", writes="shards", subcommand="convert", cold=False,
         description="ckptool convert CKPT -o DIR --max-shard-size 200MB"),
    Tool("strip", "ckptool", lambda c: _ckptool(c, "strip", str(c.inp.path), "-o", _out(c, "strip.pt")),
         job="rewrite", writes="strip.pt", subcommand="strip", description="ckptool strip CKPT -o OUT"),
    Tool("remap", "ckptool", lambda c: _ckptool(c, "remap", str(c.inp.path), "-o", _out(c, "remap.pt"), "--to", "cpu"),
         job="rewrite", writes="remap.pt", subcommand="remap", description="ckptool remap CKPT -o OUT --to cpu"),
    Tool("inspect", "ckptool", lambda c: _ckptool(c, "inspect", str(c.inp.path)), job="readonly",
         subcommand="inspect", description="ckptool inspect CKPT"),
    Tool("inspect-json", "ckptool", lambda c: _ckptool(c, "inspect", str(c.inp.path), "--json"), job="readonly",
         subcommand="inspect", description="ckptool inspect CKPT --json"),
    Tool("scan", "ckptool", lambda c: _ckptool(c, "scan", str(c.inp.path)), job="readonly", subcommand="scan",
         description="ckptool scan CKPT"),
    Tool("diff", "ckptool", lambda c: _ckptool(c, "diff", str(c.inp.path), str(c.inp.twin)), job="compare",
         twin=True, subcommand="diff", description="ckptool diff A TWIN (same weights, other order)"),
    Tool("verify", "ckptool", lambda c: _ckptool(c, "verify", str(c.inp.path), "--against", str(c.inp.twin)),
         job="compare", twin=True, subcommand="verify", needs_option="--against", max_bytes=GIB,
         description="ckptool verify A --against TWIN"),
]
TOOL_NAMES = [t.name for t in TOOLS]
ALIASES = {"naive": ["naive-st", "naive-st-mmap", "naive-st-bf16", "naive-pt", "naive-pt-mmap"],
           "baselines": ["python", "import-torch"], "disk": ["read", "read-both", "cp", "cp+sync"],
           "ckptool": ["help", "convert", "convert-bf16", "convert-shards", "strip", "remap", "inspect", "inspect-json",
                       "scan", "diff", "verify"]}
# what a row is compared with: the disk limit and the naive path of the same job
LIMIT_FOR = {"convert": "cp+sync", "rewrite": "cp+sync", "compare": "read-both", "copy": "cp+sync", "cast": "cp+sync"}
NAIVE_FOR = {"convert": "naive-st", "rewrite": "naive-pt", "cast": "naive-st-bf16"}
NAIVE_MMAP_FOR = {"convert": "naive-st-mmap", "rewrite": "naive-pt-mmap"}


def ckptool_availability(python: str) -> dict[str, str]:
    """subcommand -> '' when usable, else why not ('n/a: ...')."""
    env = child_env()
    probe = subprocess.run([python, "-m", "ckptool", "--help"], capture_output=True, text=True, env=env, cwd=REPO)
    result: dict[str, str] = {}
    for tool in TOOLS:
        if tool.group != "ckptool":
            continue
        if probe.returncode != 0:
            result[tool.name] = "n/a: ckptool does not start: " + (probe.stderr.strip().splitlines() or ["?"])[-1]
            continue
        if not tool.subcommand:
            result[tool.name] = ""
            continue
        sub = subprocess.run([python, "-m", "ckptool", tool.subcommand, "--help"], capture_output=True, text=True,
                             env=env, cwd=REPO)
        if sub.returncode != 0:
            result[tool.name] = f"n/a: no `ckptool {tool.subcommand}`"
        elif tool.needs_option and tool.needs_option not in sub.stdout:
            result[tool.name] = f"n/a: `ckptool {tool.subcommand}` has no {tool.needs_option}"
        else:
            result[tool.name] = ""
    return result


def select_tools(spec: str) -> list[Tool]:
    if not spec or spec == "all":
        return list(TOOLS)
    wanted: list[str] = []
    for name in (s.strip() for s in spec.split(",")):
        if not name:
            continue
        names = ALIASES.get(name, [name])
        for n in names:
            if n not in TOOL_NAMES:
                raise SystemExit(f"bench: unknown tool {n!r}; known: {', '.join(TOOL_NAMES)} "
                                 f"(groups: {', '.join(ALIASES)})")
            wanted.append(n)
    # the references the ratios need come along
    for n in list(wanted):
        tool = next(t for t in TOOLS if t.name == n)
        for ref in (LIMIT_FOR.get(tool.job), NAIVE_FOR.get(tool.job)):
            if ref and ref not in wanted and tool.group == "ckptool":
                wanted.append(ref)
        if tool.group in ("ckptool", "naive") and "python" not in wanted:
            wanted.append("python")
        if tool.group in ("ckptool", "naive") and "import-torch" not in wanted:
            wanted.append("import-torch")
    return [t for t in TOOLS if t.name in wanted]
