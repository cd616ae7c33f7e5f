"""torch's reading of one or more checkpoint files, for scripts/realworld.py: run ONLY as a throwaway subprocess.

    python scripts/realworld_reference.py OUT.pt FILE [FILE...]

For each FILE it writes, into OUT.pt (a plain tensors-and-builtins pickle that
``torch.load(weights_only=True)`` reads back):

- ``loader``: how torch read it: ``weights_only`` (``torch.load(weights_only=True)``), ``stubs``
  (``torch.load(weights_only=False)`` with every module the file names that is not the standard library,
  torch or numpy fabricated as inert stand-ins: see ``StubFinder``), ``jit`` (``torch.jit.load``, for a
  TorchScript archive), ``safetensors`` (``safetensors.torch.load_file``), or ``error``;
- ``error``: torch's message when every loader failed, else None;
- ``weights_only_error``: the first line of ``torch.load(weights_only=True)``'s refusal, or None;
- ``locations``: every storage's saved location tag with its count (what a GPU run wrote);
- ``dicts``: every dict in the loaded object that holds tensors, as (key path, {key: tensor}); a whole
  ``nn.Module`` (real or stand-in) contributes the dict its ``state_dict()`` would return, computed from its
  ``_parameters`` / ``_buffers`` / ``_modules`` without calling any of its code.

Why a subprocess and stand-ins: the packages these files come from are never installed nor imported. A file
torch's weights-only loader refuses (OmegaConf hyper-parameters, a whole pickled model) is still read by
torch's own unpickler, but every class it names from a foreign package is a permissive stub that records
its state; the process then exits, so nothing it built survives.
"""

from __future__ import annotations

import collections
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
import zipfile
from pathlib import Path

# modules that are really imported when a pickle names them: the standard library, torch and numpy
REAL_TOP_LEVEL = set(sys.stdlib_module_names) | {"torch", "numpy"}
MAX_DEPTH = 12


class _StubMeta(type):
    """Class attributes a pickle asks for (``Outer.Inner`` qualnames) are stand-in classes too."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return make_stub_class(cls.__module__, f"{cls.__qualname__}.{name}")


class Stub(metaclass=_StubMeta):
    """A stand-in for any foreign class or function: accepts every construction and keeps the state."""

    def __new__(cls, *args: object, **kwargs: object) -> Stub:
        instance = object.__new__(cls)
        instance.__dict__["_stub_args"] = args
        instance.__dict__["_stub_items"] = {}
        instance.__dict__["_stub_list"] = []
        return instance

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        slot_state = None
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state, slot_state = state
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif state is not None:
            self.__dict__["_stub_state"] = state
        if isinstance(slot_state, dict):
            self.__dict__.update(slot_state)

    def __setitem__(self, key: object, value: object) -> None:
        self.__dict__["_stub_items"][key] = value

    def append(self, value: object) -> None:
        self.__dict__["_stub_list"].append(value)

    def extend(self, values: object) -> None:
        self.__dict__["_stub_list"].extend(values)  # type: ignore[arg-type]

    def __call__(self, *args: object, **kwargs: object) -> Stub:
        return Stub(*args)


_CLASSES: dict[tuple[str, str], type] = {}


def make_stub_class(module: str, qualname: str) -> type:
    key = (module, qualname)
    if key not in _CLASSES:
        cls = _StubMeta(qualname.rpartition(".")[2], (Stub,), {"__module__": module, "__qualname__": qualname})
        _CLASSES[key] = cls
    return _CLASSES[key]


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return make_stub_class(self.__name__, name)


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Fabricates every module outside REAL_TOP_LEVEL, ahead of the real finders: no package code is found."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] in REAL_TOP_LEVEL:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # a package: submodules are fabricated the same way


def module_state_dict(obj: object, prefix: str = "") -> dict[str, object]:
    """What ``nn.Module.state_dict()`` returns, from the module's recorded attributes (no hooks run)."""
    import torch

    attributes = obj.__dict__
    result: dict[str, object] = {}
    non_persistent = attributes.get("_non_persistent_buffers_set") or set()
    for name, value in (attributes.get("_parameters") or {}).items():
        if value is not None:
            result[prefix + name] = value.detach() if isinstance(value, torch.Tensor) else value
    for name, value in (attributes.get("_buffers") or {}).items():
        if value is not None and name not in non_persistent:
            result[prefix + name] = value
    for name, child in (attributes.get("_modules") or {}).items():
        if child is not None:
            result.update(module_state_dict(child, prefix + name + "."))
    return result


def is_module_like(obj: object) -> bool:
    attributes = getattr(obj, "__dict__", None)
    return isinstance(attributes, dict) and "_parameters" in attributes and "_modules" in attributes


def tensor_dicts(obj: object, path: tuple = (), depth: int = 0, seen: set[int] | None = None) -> list[tuple[list, dict]]:
    """Every dict holding tensors in ``obj``, with its key path; modules as their state dicts."""
    import torch

    seen = set() if seen is None else seen
    if depth > MAX_DEPTH or id(obj) in seen:
        return []
    seen.add(id(obj))
    found: list[tuple[list, dict]] = []
    if is_module_like(obj):
        found.append((list(path), module_state_dict(obj)))
        return found
    if isinstance(obj, dict):
        tensors = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if tensors:
            found.append((list(path), tensors))
        children = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        children = list(enumerate(obj))
    elif isinstance(obj, Stub):
        children = [(k, v) for k, v in obj.__dict__.items() if not k.startswith("_stub_args")]
    else:
        children = []
    for key, value in children:
        if isinstance(value, (dict, list, tuple, Stub)) or is_module_like(value):
            step = key if isinstance(key, (str, int)) else str(key)  # the result must stay weights-only loadable
            found.extend(tensor_dicts(value, (*path, step), depth + 1, seen))
    return found


def read_one(path: Path) -> dict[str, object]:
    import torch

    locations: collections.Counter[str] = collections.Counter()

    def record(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        locations[location] += 1
        return storage

    result: dict[str, object] = {"loader": "error", "error": None, "weights_only_error": None}
    if path.suffix == ".safetensors":
        import safetensors.torch

        obj: object = safetensors.torch.load_file(str(path))
        result["loader"] = "safetensors"
    else:
        is_torchscript = zipfile.is_zipfile(path) and any(
            "/code/" in name or name.endswith("constants.pkl") for name in zipfile.ZipFile(path).namelist())
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = torch.load(path, weights_only=True, map_location=record)
            result["loader"] = "weights_only"
        except Exception as error:  # noqa: BLE001 — torch's refusal is recorded, then the next loader tries
            result["weights_only_error"] = (str(error).strip().splitlines() or [""])[0]
            locations.clear()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if is_torchscript:
                        obj = dict(torch.jit.load(str(path), map_location="cpu").state_dict())
                        result["loader"] = "jit"
                    else:
                        sys.meta_path.insert(0, StubFinder())
                        obj = torch.load(path, weights_only=False, map_location=record)
                        result["loader"] = "stubs"
            except Exception as second:  # noqa: BLE001
                result["error"] = f"{type(second).__name__}: {second}"
                obj = None
    result["locations"] = dict(locations)
    result["dicts"] = tensor_dicts(obj) if obj is not None else []
    return result


def main(argv: list[str]) -> int:
    import safetensors.torch  # noqa: F401 — before any stub finder: a stubbed-in safetensors would read nothing
    import torch

    out, *files = argv
    results = {name: read_one(Path(name)) for name in files}
    torch.save(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
