"""`.pt` rewrites of what other people's packages save: numpy values, defaultdicts, config objects,
whole nn.Modules, protocol-4 pickles.

Each input is made by a real ``torch.save`` (in a subprocess, with stand-in packages written into
tmp_path on its path), rewritten by every command that writes a ``.pt`` (strip, add-prefix, remap,
convert), and compared by a throwaway subprocess that loads input and output with
``torch.load(weights_only=False)``: entry for entry, with the input's sharing kept, and no global
in the output that the input did not name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptool.cli.main import main
from ckptool.pickles.allowlist import DEFAULT_EXTRA_GLOBALS, TORCH_GLOBALS, python3_name

# A stand-in for OmegaConf (not installed): classes built and pickled the way its configs are —
# objects whose __dict__ holds metadata naming classes (object_type=dict/list, typing.Any), child
# nodes pointing back at their parent (a cycle), an Enum, dict and list subclasses with items and
# attributes, an object with __slots__ and a __dict__ (BUILD's (state, slotstate) pair), and one
# built by keyword arguments (NEWOBJ_EX under protocol 4).
FAKEOMEGA = {
    "fakeomega/__init__.py": "",
    "fakeomega/base.py": '''
        import enum
        from dataclasses import dataclass, field
        from typing import Any

        class Kind(enum.Enum):
            PLAIN = 1
            STRUCTURED = 2

        @dataclass
        class Metadata:
            ref_type: Any
            object_type: Any
            optional: bool
            key: Any
            flags: dict = field(default_factory=dict)
            key_type: Any = Any
            element_type: Any = Any
            kind: Kind = Kind.PLAIN
    ''',
    "fakeomega/nodes.py": '''
        class AnyNode:
            def __init__(self, value, key=None, parent=None):
                self._val, self._key, self._parent = value, key, parent
                self._flags = {}

        class Slotted:
            __slots__ = ("a", "b", "__dict__")
            def __init__(self):
                self.a, self.b, self.note = 1, [2.5], "x"

        class KeywordBuilt:
            def __new__(cls, a, *, b):
                obj = object.__new__(cls)
                obj.a, obj.b = a, b
                return obj
            def __getnewargs_ex__(self):
                return (self.a,), {"b": self.b}

        class Bag(dict):
            pass

        class Outer:  # protocol 4 names the inner class by STACK_GLOBAL: module + "Outer.Inner"
            class Inner:
                def __init__(self):
                    self.x = 1

        class Row(list):
            pass
    ''',
    "fakeomega/dictconfig.py": '''
        from typing import Any
        from .base import Metadata
        from .nodes import AnyNode

        class DictConfig:
            def __init__(self, content, parent=None, key=None):
                self._metadata = Metadata(ref_type=Any, object_type=dict, optional=True, key=key,
                                          flags={"readonly": False})
                self._parent = parent
                self._content = {k: AnyNode(v, k, self) for k, v in content.items()}

        class ListConfig:
            def __init__(self, items, parent=None, key=None):
                self._metadata = Metadata(ref_type=Any, object_type=list, optional=True, key=key)
                self._parent = parent
                self._content = [AnyNode(v, i, self) for i, v in enumerate(items)]
    ''',
}

# How each input is built (the body of a script run with tmp_path on sys.path). Every one holds a
# DDP-like state dict under "state_dict" (a real module's, with its _metadata) so strip and add-prefix
# have weights to rename.
PRELUDE = '''
    import collections, math, sys, typing
    import numpy as np
    import torch
    from torch import nn

    torch.manual_seed(0)
    class Wrapper(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    ddp = Wrapper(net).state_dict()   # module.0.weight ..., _metadata {"", "module", "module.0", ...}
'''

CASES: dict[str, str] = {
    "numpy": '''
        shared = np.arange(6, dtype=np.float32).reshape(2, 3)
        obj = {"state_dict": ddp,
               "arrays": {"f32": shared, "again": shared, "i8": np.array([-1, 2], dtype=np.int8),
                          "bool": np.array([True, False]), "f16": np.ones((2, 2), dtype=np.float16),
                          "c64": np.array([1 + 2j], dtype=np.complex64), "u16": np.arange(4, dtype=np.uint16),
                          "big": np.arange(3, dtype=">i4"), "zero_d": np.array(3.5),
                          "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
                          "empty": np.zeros((0, 3)), "nan": np.array([np.nan, np.inf, -np.inf]),
                          "record": np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")]),
                          "days": np.array(["2024-01-01"], dtype="datetime64[D]")},
               "scalars": [np.int64(7), np.float32(0.5), np.float64(np.nan), np.bool_(True), np.uint8(255)],
               "rng": np.random.RandomState(0).get_state()}
    ''',
    "builtins": '''
        losses = collections.defaultdict(list)
        losses["train"].extend([0.5, 0.25])
        losses["val"].append(math.inf)
        per_layer = collections.defaultdict(collections.OrderedDict)
        per_layer["a"]["x"] = 1
        loop = [1, "two"]
        loop.append(loop)
        shared = {"lr": 0.1}
        obj = {"state_dict": ddp, "losses": losses, "counts": collections.defaultdict(int, {"a": 3}),
               "per_layer": per_layer,
               "metrics": {"best": math.inf, "worst": -math.inf, "undefined": math.nan,
                           "nested": {"deep": {"deeper": [math.nan, -0.0, 1e308, 5e-324]}}},
               "blobs": [b"", b"\\x00\\xff" * 3, bytearray(b"ab"), "caf\\u00e9 \\U0001f600"],
               "numbers": [2**70, -2**70, -1, 0, 255, 65535, 2**31, complex(1, -2)],
               "sets": [set(), {1, 2, "a"}, frozenset({3, 4})],
               "tuples": ((), (1,), (1, 2, (3, 4, (5,))), tuple(range(10))),
               "loop": loop, "shared": [shared, shared, {"same": shared}],
               "counter": collections.Counter({"a": 2}), "optimizer": torch.optim.SGD(net.parameters(), lr=0.1,
                                                                                      momentum=0.9).state_dict()}
    ''',
    "omegaconf": '''
        from fakeomega.dictconfig import DictConfig, ListConfig
        from fakeomega.nodes import Bag, Row, Slotted
        from fakeomega.base import Kind
        config = DictConfig({"lr": 0.1, "layers": 4, "name": "run"})
        config._content["sizes"] = ListConfig([1, 2], parent=config, key="sizes")
        bag = Bag(a=1, b=[2])
        bag.note = "attr"
        row = Row([1, 2, 3])
        row.note = "attr"
        obj = {"state_dict": ddp, "hyper_parameters": config, "bag": bag, "row": row, "slotted": Slotted(),
               "kind": Kind.STRUCTURED, "types": [typing.Any, dict, list, int]}
    ''',
    "module": '''
        # the encoder layer keeps its activation as a function global (torch.nn.functional.relu)
        obj = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Dropout(0.1),
                            nn.TransformerEncoderLayer(d_model=4, nhead=2, dim_feedforward=8))
        obj.register_buffer("scale", torch.ones(2), persistent=False)
        obj[0].weight.requires_grad_(False)
    ''',
    "module_in_dict": '''
        head = nn.Linear(2, 2)
        model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), head, head,  # one module twice: shared
                              nn.TransformerDecoderLayer(d_model=2, nhead=1, dim_feedforward=4, activation="gelu"))
        obj = {"model": model, "state_dict": ddp, "epoch": 3}
    ''',
    "protocol1": '''
        from fakeomega.dictconfig import DictConfig
        config = DictConfig({"lr": 0.1})  # copy_reg._reconstructor(cls, object, None), then BUILD
        obj = {"state_dict": ddp, "config": config, "again": config, "sets": [{1}, frozenset({2})]}
        torch.save(obj, sys.argv[1], pickle_protocol=1)
        raise SystemExit(0)
    ''',
    "protocol4": '''
        from fakeomega.nodes import KeywordBuilt, Outer
        obj = {"state_dict": ddp, "built": KeywordBuilt(1, b=[2, torch.ones(3)]), "sets": [{1, 2}, frozenset({"a"})],
               "bytes": b"\\x00\\x01", "nested": [Outer.Inner(), Outer.Inner, Outer()]}
        torch.save(obj, sys.argv[1], pickle_protocol=4)
        raise SystemExit(0)
    ''',
}

# Compare the loaded input with each loaded output: same types, same entries in the same order,
# tensors and numpy arrays equal with the same dtype, nan equal to nan, objects by their __dict__
# and slots, and the input's sharing kept (an object met twice in the input is one object in the
# output too). Keys renamed by strip/add-prefix are mapped back first.
COMPARE = '''
import collections, math, sys
import numpy as np
import torch

KEEP = []

def equal(a, b, where, pairs):
    if type(a) is not type(b):
        raise AssertionError(f"{where}: {type(a).__name__} != {type(b).__name__}")
    if isinstance(a, (bool, int, str, bytes, complex, type(None))):
        assert a == b, (where, a, b)
        return
    if isinstance(a, float):
        assert a == b and math.copysign(1, a) == math.copysign(1, b) or (math.isnan(a) and math.isnan(b)), (where, a, b)
        return
    if id(a) in pairs:
        assert pairs[id(a)] is b, f"{where}: shared in the input, not in the output"
        return
    pairs[id(a)] = b
    if isinstance(a, type) or callable(a) and not hasattr(a, "__dict__"):
        assert a is b, (where, a, b)
        return
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), where
        assert torch.equal(a, b) and a.requires_grad == b.requires_grad, where
        assert type(a) is type(b), where
        return
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.flags.f_contiguous == b.flags.f_contiguous, where
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), where
        return
    if isinstance(a, np.generic):
        assert a.dtype == b.dtype and (a == b or (np.isnan(a) and np.isnan(b))), where
        return
    if isinstance(a, np.dtype):
        assert a == b, where
        return
    if isinstance(a, (set, frozenset)):
        assert a == b, where
        return
    if isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for key in a:
            equal(dict.__getitem__(a, key), dict.__getitem__(b, key), f"{where}[{key!r}]", pairs)
        if hasattr(a, "default_factory"):
            assert a.default_factory is b.default_factory, where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            equal(x, y, f"{where}[{i}]", pairs)
    if isinstance(a, torch.nn.Module):
        sa, sb = a.state_dict(), b.state_dict()
        assert list(sa) == list(sb), where
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (where, key)
    for slot in getattr(type(a), "__slots__", ()):
        if slot != "__dict__" and hasattr(a, slot):
            equal(getattr(a, slot), getattr(b, slot), f"{where}.{slot}", pairs)
    if hasattr(a, "__dict__") and not isinstance(a, type):
        attributes = (dict(vars(a)), dict(vars(b)))
        KEEP.append(attributes)  # alive to the end, so no later object reuses their ids in pairs
        equal(*attributes, f"{where}.__dict__", pairs)

def renamed(obj, old, new):
    """The input as the command should leave it: state_dict keys and their _metadata renamed."""
    if not isinstance(obj, dict) or "state_dict" not in obj:
        return obj
    sd = obj["state_dict"]
    copy = type(sd)((new + k[len(old):] if k.startswith(old) else k, v) for k, v in sd.items())
    meta = collections.OrderedDict()
    for k, v in sd._metadata.items():
        if not k:
            meta[new[:-1]] = v
        elif k != old[:-1] and k.startswith(old):
            meta[new + k[len(old):]] = v
    copy._metadata = meta
    return {**obj, "state_dict": copy}

original = torch.load(sys.argv[1], weights_only=False)
for arg in sys.argv[2:]:
    path, old, new = arg.split("|")
    output = torch.load(path, weights_only=False)
    equal(renamed(original, old, new), renamed(output, "", ""), path, {})
print("equal", len(sys.argv) - 2)
'''


def _write_module(root: Path) -> None:
    for name, text in FAKEOMEGA.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _python(root: Path, script: str, *args: str) -> str:
    environment = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script, *args], cwd=root, env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def _make(tmp_path: Path, case: str) -> Path:
    _write_module(tmp_path)
    source = tmp_path / f"{case}.pt"
    body = textwrap.dedent(PRELUDE) + textwrap.dedent(CASES[case]) + "\ntorch.save(obj, sys.argv[1])\n"
    _python(tmp_path, body, str(source))
    return source


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout + result.stderr


def _globals(path: Path) -> set[str]:
    code, out = _cli("scan", "--json", path)
    assert code in (0, 1), out
    return {python3_name(name) for name in json.loads(out)["globals"]}


def _allow(path: Path) -> list[str]:
    code, out = _cli("scan", "--json", path)
    flags: list[str] = []
    for name in json.loads(out)["unsafe"]:
        flags += ["--allow-global", name]
    return flags


# (command, extra arguments, the key prefix it renames: old|new)
REWRITES = [
    ("strip", [], "module.|"),
    ("add-prefix", ["--prefix", "x."], "|x."),
    ("remap", ["--to", "cpu"], "|"),
    ("convert", [], "|"),
]


@pytest.mark.parametrize("case", ["numpy", "builtins", "omegaconf", "module_in_dict", "protocol1", "protocol4"])
def test_every_pt_rewrite_keeps_every_entry(tmp_path: Path, case: str) -> None:
    source = _make(tmp_path, case)
    allow = _allow(source)
    before = _globals(source)
    outputs = []
    for command, extra, rename in REWRITES:
        out = tmp_path / f"out-{command}.pt"
        code, text = _cli(command, source, "-o", out, *extra, *allow)
        assert code == 0, f"{command}: {text}"
        outputs.append(f"{out}|{rename}")
        after = _globals(out)
        if case == "protocol4":
            # sets and bytes a protocol-4 pickle writes by opcode are written as torch's own
            # protocol-2 spellings, from torch's allowed set; anything else only as the input named it
            assert after - before <= {"builtins.set", "_codecs.encode"}, (command, after - before)
        else:
            assert after <= before, (command, after - before)
    assert _python(tmp_path, COMPARE, str(source), *outputs).startswith("equal")


def test_a_whole_module_pickle_rewrites_to_an_equal_module(tmp_path: Path) -> None:
    source = _make(tmp_path, "module")
    allow = _allow(source)
    assert "torch.nn.modules.conv.Conv2d" in allow
    outputs = []
    # remap only: strip, add-prefix and convert of a whole model write its weights as a plain state dict
    for command, extra, rename in REWRITES[2:3]:
        out = tmp_path / f"out-{command}.pt"
        code, text = _cli(command, source, "-o", out, *extra, *allow)
        assert code == 0, f"{command}: {text}"
        assert _globals(out) <= _globals(source)
        outputs.append(f"{out}|{rename}")
    assert _python(tmp_path, COMPARE, str(source), *outputs).startswith("equal")


def test_a_rewrite_never_names_a_global_the_read_did_not_allow(tmp_path: Path) -> None:
    """Without the flags the input is refused (exit 3, nothing written); with them, the output's
    globals are the input's allowed ones and torch's own."""
    source = _make(tmp_path, "omegaconf")
    out = tmp_path / "out.pt"
    code, text = _cli("remap", source, "-o", out, "--to", "cpu")
    assert code == 3 and not out.exists(), text
    code, text = _cli("remap", source, "-o", out, "--to", "cpu", *_allow(source))
    assert code == 0, text
    after = _globals(out)
    assert after <= _globals(source)
    assert {name for name in after if name not in TORCH_GLOBALS} == {
        python3_name(name) for name in _allow(source)[1::2]} | (_globals(source) & set(DEFAULT_EXTRA_GLOBALS))


def test_state_set_twice_on_an_object_is_refused_not_half_kept(tmp_path: Path) -> None:
    """Two BUILDs on one object (no pickler writes them): the class would apply both, a rewrite could
    keep one — the file is refused, on reading, with nothing written."""
    from hostile import dct, glob, make_zip, text, torch_members, whole

    state = dct((text("a"), text("b")))
    thing = glob("fakeomega.nodes", "AnyNode") + b")\x81" + state + b"b" + state + b"b"  # EMPTY_TUPLE NEWOBJ
    source = tmp_path / "twice.pt"
    source.write_bytes(make_zip(torch_members(whole(dct((text("thing"), thing))))))
    out = tmp_path / "out.pt"
    code, text_ = _cli("remap", source, "-o", out, "--to", "cpu", "--allow-global", "fakeomega.nodes.AnyNode")
    assert code == 3 and not out.exists(), text_
    assert "twice" in text_ and str(source) in text_ and "Traceback" not in text_


def test_a_shared_string_and_single_items_keep_pickles_shapes() -> None:
    """A long string the tree shares is written once (as pickle memoises it); an object given one
    item gets it by APPEND/SETITEM, as pickle writes a batch of one (the class's append, not extend)."""
    import pickle
    import pickletools

    from ckptool.pickles import dump
    from ckptool.pickles.placeholders import opaque_type

    note = "a long note shared by several entries " * 4
    row = opaque_type("fakeomega.nodes.Row")()
    row.append(1)
    bag = opaque_type("fakeomega.nodes.Bag")()
    bag["only"] = 2
    blob, _ = dump({"a": note, "b": note, "row": row, "bag": bag, "many": [1, 2], "one": [3]})
    assert blob.count(note.encode()) == 1
    names = [op.name for op, _, _ in pickletools.genops(blob)]
    assert names.count("APPEND") == 2 and names.count("SETITEM") == 1, names
    loaded = pickle.loads(blob.replace(b"cfakeomega.nodes\nRow", b"c__builtin__\nlist")
                          .replace(b"cfakeomega.nodes\nBag", b"c__builtin__\ndict"))
    assert loaded["a"] is loaded["b"] and loaded["row"] == [1] and loaded["bag"] == {"only": 2}


@pytest.mark.parametrize("after", ["state", "set items"])
def test_items_after_what_pickle_writes_last_are_refused(tmp_path: Path, after: str) -> None:
    """pickle gives an object its appended items, its set items, then its state; a rewrite writes
    them back in that order, so a pickle that gives them otherwise (no pickler does) is refused."""
    from hostile import dct, glob, make_zip, text, torch_members, whole

    late = b"(" + text("x") + b"e"  # MARK item APPENDS
    if after == "state":
        thing = glob("fakeomega.nodes", "Row") + b")\x81" + dct((text("a"), text("b"))) + b"b" + late
    else:
        thing = glob("fakeomega.nodes", "Row") + b")\x81" + text("k") + text("v") + b"s" + late  # SETITEM
    source = tmp_path / "late.pt"
    source.write_bytes(make_zip(torch_members(whole(dct((text("thing"), thing))))))
    out = tmp_path / "out.pt"
    code, text_ = _cli("remap", source, "-o", out, "--to", "cpu", "--allow-global", "fakeomega.nodes.Row")
    assert code == 3 and not out.exists(), text_
    assert f"after its {after}" in text_.replace("state (BUILD)", "state") and "Traceback" not in text_
