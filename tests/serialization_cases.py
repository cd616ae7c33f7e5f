"""Files made by real ``torch.save`` under the scenarios of PyTorch's own ``test/test_serialization.py``.

One function per family writes a few small files into a directory and returns their paths. Each file
holds a flat dict (tensors at the top level where the scenario allows, so ``inspect`` lists them).
A scenario the installed torch cannot save is skipped, never faked. Files torch itself must be
made to write differently (big-endian records, hand-built rebuild calls) are produced the way
test_serialization.py produces them: by rewriting a saved archive, or by pickling a rebuild call
through torch's own pickler.

``tests/test_serialization_suite.py`` reads every file with ``torch.load(weights_only=True)`` and
with ckptool, and counts per family what ckptool reads, refuses and gets wrong.
"""

from __future__ import annotations

import io
import pickle
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class Crafted:
    """Pickles as ``fn(*args)``: a rebuild call as torch writes it, built by hand."""

    def __init__(self, fn: Any, args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce_ex__(self, protocol: int) -> tuple:
        return self.fn, self.args


def _save(path: Path, obj: Any, **kwargs: Any) -> Path | None:
    """torch.save, or None when the installed torch cannot write the scenario."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.save(obj, path, **kwargs)
    except Exception:
        path.unlink(missing_ok=True)
        return None
    return path


def _pattern(dtype: torch.dtype, n: int = 6) -> torch.Tensor:
    """A small tensor of ``dtype`` with varied bits: signs, a NaN payload and -0.0 for floats."""
    if dtype == torch.bool:
        return torch.tensor([True, False, True, True, False, False][:n])
    if dtype.is_floating_point and dtype.itemsize >= 2:
        values = torch.tensor([1.5, -0.0, float("nan"), -2.25, float("inf"), 3.0][:n], dtype=torch.float64)
        tensor = values.to(dtype)
        if dtype == torch.float32:  # a NaN with a payload other than the default
            tensor.view(torch.int32)[2] = 0x7FC00123
        return tensor
    if dtype.is_complex:
        real = torch.tensor([1.5, -0.0, float("nan"), -2.25, 0.5, 3.0][:n])
        return torch.complex(real, torch.tensor([-1.0, 2.0, 0.0, -0.0, 4.0, -8.0][:n])).to(dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    data = bytes((17 * i + 3) % 256 for i in range(n * itemsize))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).clone()


# ---------------------------------------------------------------------------------------------- families

# test_serialization.py: test_serialization_{float,half,...}, _test_serialization_dtypes, test_save_load_dtypes
ALL_DTYPES = [name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)
              and name == str(getattr(torch, name)).removeprefix("torch.")]


def dtypes(directory: Path) -> list[Path]:
    made: list[Path] = []
    for name in ALL_DTYPES:
        dtype = getattr(torch, name)
        if name.startswith("q") or name in ("bcomplex32",):  # quantized dtypes are their own family
            continue
        try:
            tensor = _pattern(dtype) if name not in ("complex32",) else _pattern(torch.complex64).to(dtype)
        except Exception:
            try:
                tensor = torch.frombuffer(bytearray(range(7, 13)), dtype=torch.uint8).view(dtype).clone()
            except Exception:
                try:
                    tensor = torch.empty(3, dtype=dtype)
                except Exception:
                    continue
        path = _save(directory / f"dtype_{name}.pt", {"w": tensor, "v": tensor[1:]})
        if path:
            made.append(path)
    return made


# test_serialization_offset, test_serialization_backwards_compat views, test_save_different_dtype_views,
# test_serialization_storage_slice, test_tensor_subclass views, test_filelike shares
def views(directory: Path) -> list[Path]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    made = [
        _save(directory / "views_shared.pt", {"base": base, "row": base[1], "col": base[:, 2], "t": base.t(),
                                             "step": base[::2, 1::3], "empty": base[4:], "scalar": base[3, 5]}),
        _save(directory / "views_offset.pt", {"w": torch.arange(10.0)[3:7], "b": torch.arange(10.0)[:2]}),
        _save(directory / "views_expanded.pt", {"e": torch.tensor([1.0, 2.0]).expand(3, 2)}),
        # test_save_different_dtype_views: one storage, tensors of different dtypes on it
        _save(directory / "views_dtypes.pt", _dtype_views()),
        _save(directory / "views_channels_last.pt",
              {"w": torch.arange(48.0).reshape(2, 3, 2, 4).contiguous(memory_format=torch.channels_last)}),
        # overlapping windows of one storage (unfold), 0-dim and empty tensors, a view of a view
        _save(directory / "views_overlap.pt", {"win": torch.arange(10.0).unfold(0, 4, 2), "base": torch.arange(3.0)}),
        _save(directory / "views_scalars_empty.pt", {"s": torch.tensor(-0.0), "e": torch.empty(0, 3),
                                                     "i": torch.tensor(7, dtype=torch.int64)}),
        _save(directory / "views_of_views.pt", (lambda b: {"b": b, "v": b[1:][::2].t()[1]})(
            torch.arange(30.0).reshape(5, 6))),
        _save(directory / "views_legacy.pt", (lambda b: {"b": b, "col": b[:, 1], "win": b.reshape(-1).unfold(0, 3, 2)})(
            torch.arange(12.0).reshape(3, 4)), _use_new_zipfile_serialization=False),
    ]
    return [p for p in made if p]


def _dtype_views() -> dict:
    a = torch.arange(8, dtype=torch.float32)
    return {"f": a, "i": a.view(torch.int32), "b": a.view(torch.uint8), "h": a.view(torch.float16)[2:6]}


# test_serialization_parameter, test_parameter_state, test_serialization_save_warnings (Parameter)
def parameters(directory: Path) -> list[Path]:
    p = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    q = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    r = torch.nn.Parameter(torch.arange(4.0))
    r.custom_flag = True  # a plain attribute: saved as state
    module = torch.nn.Linear(3, 2)
    made = [
        _save(directory / "param_plain.pt", {"p": p, "q": q}),
        _save(directory / "param_state.pt", {"r": r}),
        _save(directory / "param_module.pt", module.state_dict(keep_vars=True)),
        _save(directory / "param_state_dict.pt", module.state_dict()),
        _save(directory / "param_legacy.pt", {"p": p, "q": q, "r": r}, _use_new_zipfile_serialization=False),
        # a parameter sharing its storage with a plain tensor view of it (tied weights)
        _save(directory / "param_tied.pt", {"embed": p, "head": p.detach()[1:]}),
    ]
    return [x for x in made if x]


# test_serialization_conj, test_serialization_neg (_test_save_load_attr), test_serialization_math_bits
def conjneg(directory: Path) -> list[Path]:
    z = torch.complex(torch.arange(1.0, 7.0), torch.arange(-3.0, 3.0))
    made = [
        _save(directory / "bits_conj.pt", {"c": z.conj(), "plain": z}),
        _save(directory / "bits_neg.pt", {"n": torch._neg_view(torch.arange(1.0, 5.0)),
                                          "i": torch._neg_view(torch.arange(1, 5, dtype=torch.int32))}),
        _save(directory / "bits_conj_neg_view.pt", {"cn": torch._neg_view(z.conj())[1:4]}),
    ]
    return [x for x in made if x]


# test_serialization_container(s), test_serialization_dill-free plain containers, test_serialization_map_location
def containers(directory: Path) -> list[Path]:
    made = [
        _save(directory / "cont_nested.pt", {"model": OrderedDict(w=torch.ones(2), b=torch.zeros(2)), "epoch": 3,
                                            "lr": 0.1, "name": "run", "none": None, "flags": (True, False),
                                            "hist": [1.5, -0.0, float("nan")]}),
        _save(directory / "cont_set_bytes_complex.pt", {"meta": {"ids": {1, 2, 3}, "blob": bytearray(b"\x00\x01"),
                                                                "z": complex(1, -2), "raw": b"\xff\x00"},
                                                       "w": torch.ones(2), "b": torch.zeros(1)}),
        _save(directory / "cont_tensor_list.pt", [torch.arange(3.0), torch.arange(3, dtype=torch.int64)]),
        _save(directory / "cont_bare_tensor.pt", torch.arange(5.0)),
        _save(directory / "cont_counter_device.pt", {"w": torch.ones(1), "size": torch.Size([2, 3]),
                                                    "dev": torch.device("cpu"), "dt": torch.float16}),
        # a resumable training dict: weights under "model", optimizer state sharing nothing, scalars
        _save(directory / "cont_training.pt", _training_dict()),
        _save(directory / "cont_tuples_lists.pt", {"w": torch.ones(2), "b": torch.zeros(2),
                                                  "pairs": [(torch.arange(2.0), 1), (torch.arange(3.0), 2)]}),
        _save(directory / "cont_int_keys.pt", {0: torch.ones(2), 1: torch.arange(3)}),
    ]
    return [x for x in made if x]


def _training_dict() -> dict:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 4, "best": 0.25}


# test_serialization_untyped_storage / typed storages / test_storage_(un)typed / test_save_storage
def storages(directory: Path) -> list[Path]:
    t = torch.arange(6, dtype=torch.int16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        typed = torch.FloatStorage(4).fill_(2.5) if hasattr(torch, "FloatStorage") else None
        made = [
            # test_save_different_dtype_error: a tensor and an untyped view of its storage cannot be saved together
            _save(directory / "storage_untyped.pt", {"s": t.untyped_storage(), "u": torch.arange(3, dtype=torch.uint8)}),
            _save(directory / "storage_typed_of_tensor.pt", {"w": t, "s": t.storage()}),
            _save(directory / "storage_typed.pt", {"s": typed}) if typed is not None else None,
        ]
    return [x for x in made if x]


# SerializationMixin._test_serialization_data: tensors repeated in a list, storages of a tensor and of a
# view of it, an int tensor, a tuple naming one storage twice, saved zip and legacy
def _serialization_data() -> list:
    a = [torch.arange(25.0).reshape(5, 5) - 12 for _ in range(2)]
    a[1] = a[1] * 0.5
    b: list = [a[i % 2] for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b += [a[0].storage(), a[0].reshape(-1)[1:4].storage(), torch.arange(1, 11).int()]
        t1 = torch.FloatTensor().set_(a[0].reshape(-1)[1:4].clone().storage(), 0, (3,), (1,))
        t2 = torch.FloatTensor().set_(a[0].reshape(-1)[1:4].clone().storage(), 0, (3,), (1,))
        b += [(t1.storage(), t1.storage(), t2.storage()), a[0].reshape(-1)[0:2].storage()]
    return b


def serialization_data(directory: Path) -> list[Path]:
    made = [_save(directory / "mixin_data.pt", _serialization_data()),
            _save(directory / "mixin_data_legacy.pt", _serialization_data(), _use_new_zipfile_serialization=False)]
    # _test_serialization: a legacy file Python 2.7 and torch 0.4.1 wrote, its first element utf-8 bytes
    # pickled as a str (read back as text)
    (directory / "py2_utf8_legacy.pt").write_bytes(
        b'\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02M\xe9\x03.'
        b'\x80\x02}q\x01(U\x10protocol_versionq\x02M\xe9\x03U\n'
        b'type_sizesq\x03}q\x04(U\x03intq\x05K\x04U\x05shortq\x06K\x02U'
        b'\x04longq\x07K\x04uU\rlittle_endianq\x08\x88u.\x80\x02]q'
        b'\x01(U\x0e\xc5\xbc\xc4\x85\xc4\x85\xc3\xb3\xc5\xbc\xc4\x85'
        b'\xc5\xbcq\x02ctorch._utils\n_rebuild_tensor_v2\nq\x03((U'
        b'\x07storageq\x04ctorch\nFloatStorage\nq\x05U\x0845640624q'
        b'\x06U\x03cpuq\x07\x8a\x01\x01NtQK\x00K\x01\x85K\x01\x85'
        b'\x89NtRq\x08K\x02e.\x80\x02]q\x01U\x0845640624q\x02a.\x01\x00'
        b'\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00')
    made.append(directory / "py2_utf8_legacy.pt")
    return [x for x in made if x]


# test_serialization_pickle_protocols (test_pickle_protocols 1..5 via pickle_protocol=)
def protocols(directory: Path) -> list[Path]:
    obj = {"w": torch.arange(4.0), "b": torch.ones(2, dtype=torch.bfloat16), "epoch": 2, "name": "x"}
    made = [_save(directory / f"proto_{n}.pt", obj, pickle_protocol=n) for n in (1, 2, 3, 4, 5)]
    made += [_save(directory / f"proto_{n}_legacy.pt", obj, pickle_protocol=n, _use_new_zipfile_serialization=False)
             for n in (1, 2, 3, 4, 5)]
    return [x for x in made if x]


# test_serialization_legacy (_use_new_zipfile_serialization=False), test_serialization_backwards_compat
def legacy(directory: Path) -> list[Path]:
    base = torch.arange(12.0).reshape(3, 4)
    z = torch.complex(torch.arange(2.0), torch.ones(2))
    made = [
        _save(directory / "legacy_views.pt", {"base": base, "row": base[1], "t": base.t()},
              _use_new_zipfile_serialization=False),
        _save(directory / "legacy_dtypes.pt", {"h": _pattern(torch.float16), "i": _pattern(torch.int64),
                                              "bf": _pattern(torch.bfloat16), "c": z.conj()},
              _use_new_zipfile_serialization=False),
        _save(directory / "legacy_param.pt", {"p": torch.nn.Parameter(torch.ones(2))}, _use_new_zipfile_serialization=False),
    ]
    return [x for x in made if x]


class _Stored:
    """A storage in a hand-written legacy file: its type global, key, location, elements, view record."""

    def __init__(self, storage_type: Any, key: str, data: bytes, numel: int, view: tuple | None = None,
                 location: str = "cpu") -> None:
        self.storage_type, self.key, self.data, self.numel, self.view = storage_type, key, data, numel, view
        self.location = location


LITTLE_ENDIAN_INFO = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}


def _legacy_file(path: Path, obj: Any, storages: list[_Stored], sys_info: Any = LITTLE_ENDIAN_INFO) -> Path:
    """A legacy stream as torch < 1.6 wrote it (torch.serialization._legacy_save's layout), with
    persistent records torch.save no longer writes: storage views (pre-0.4), torch.cuda storage types;
    ``sys_info`` is the system-info record (torch ignores it)."""
    buffer = io.BytesIO()
    for value in (torch.serialization.MAGIC_NUMBER, torch.serialization.PROTOCOL_VERSION, sys_info):
        pickle.dump(value, buffer, protocol=2)

    class Writer(pickle.Pickler):
        def persistent_id(self, item: Any) -> Any:
            if isinstance(item, _Stored):
                return ("storage", item.storage_type, item.key, item.location, item.numel, item.view)
            return None

    Writer(buffer, protocol=2).dump(obj)
    roots = [stored for stored in storages if stored.view is None]
    pickle.dump([stored.key for stored in roots], buffer, protocol=2)
    for stored in roots:
        buffer.write(stored.numel.to_bytes(8, "little"))
        buffer.write(stored.data)
    path.write_bytes(buffer.getvalue())
    return path


def _rebuild(storage: _Stored, offset: int, size: tuple, stride: tuple) -> Crafted:
    return Crafted(torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, False, OrderedDict()))


# test_serialization_backwards_compat / test_load_legacy_file / legacy storage views (torch < 0.4 saved a
# slice of a storage as its own record: (view key, offset, size) of a root storage) and torch.cuda.* storage
# types (what a GPU tensor's storage was named before typed storages lost their device)
def legacy_records(directory: Path) -> list[Path]:
    data = torch.arange(10, dtype=torch.float32).numpy().tobytes()
    root = _Stored(torch.FloatStorage, "root", data, 10)
    view = _Stored(torch.FloatStorage, "root", b"", 10, view=("view0", 3, 4))
    made = [_legacy_file(directory / "legacy_storage_slice.pt",
                         {"whole": _rebuild(root, 0, (10,), (1,)), "slice": _rebuild(view, 1, (2,), (1,)),
                          "slice_t": _rebuild(view, 0, (2, 2), (1, 2))}, [root, view])]
    cuda_type = getattr(torch.cuda, "FloatStorage", None)
    if cuda_type is not None:
        cuda = _Stored(cuda_type, "c", data, 10)
        made.append(_legacy_file(directory / "legacy_cuda_storage_type.pt",
                                 {"w": _rebuild(cuda, 2, (3,), (2,)), "b": _rebuild(cuda, 0, (10,), (1,))}, [cuda]))
    # the system-info record torch writes and ignores on load: a big-endian flag, long of 8 bytes, none at all
    plain = {"w": _rebuild(root, 0, (10,), (1,)), "b": _rebuild(root, 2, (4,), (2,))}
    for name, info in (("big_endian", {**LITTLE_ENDIAN_INFO, "little_endian": False}),
                       ("long8", {**LITTLE_ENDIAN_INFO, "type_sizes": {"short": 2, "int": 4, "long": 8}}),
                       ("none", None), ("empty", {})):
        made.append(_legacy_file(directory / f"legacy_sys_info_{name}.pt", plain, [root], sys_info=info))
    return made


def _rewrite_zip(source: Path, target: Path, change: Callable[[str, bytes], bytes | None]) -> Path:
    """Copy a torch zip member by member through ``change`` (None drops the member)."""
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
        for info in archive.infolist():
            data = change(info.filename, archive.read(info))
            if data is not None:
                out.writestr(info.filename, data)
    return target


# test_serialization_load_bigendian / test_serialization_byteorder / test_serialization_byteorder_mark:
# files with a byteorder record; torch swaps every storage of a "big" file on load
def byteorder(directory: Path) -> list[Path]:
    made: list[Path] = []
    tensors = {"f": _pattern(torch.float32), "d": _pattern(torch.float64), "h": _pattern(torch.float16),
               "i": _pattern(torch.int32), "l": _pattern(torch.int64), "c": _pattern(torch.complex64),
               "b": _pattern(torch.bool), "u8": _pattern(torch.uint8), "bf": _pattern(torch.bfloat16),
               "c128": _pattern(torch.complex128)}
    grid = torch.arange(12, dtype=torch.int16).reshape(3, 4) * 257
    tensors.update({"grid": grid, "grid_t": grid.t(), "grid_row": grid[1, 1:], "untyped_u16": _pattern(torch.uint16)})
    with warnings.catch_warnings():  # a qint32 storage swaps by 4 bytes, its parameters as theirs
        warnings.simplefilter("ignore")
        tensors.update({"q32": torch.quantize_per_tensor(torch.arange(6.0), 1e-3, 7, torch.qint32),
                        "qc": torch.quantize_per_channel(torch.arange(6.0).reshape(2, 3), torch.tensor([0.5, 0.25]),
                                                         torch.tensor([1, -2]), 0, torch.qint32)})
    source = _save(directory / "byteorder_src.tmp", tensors)
    if source is None:
        return made
    units = _storage_units(source)

    def big(name: str, data: bytes) -> bytes:
        if name.endswith("/byteorder"):
            return b"big"
        unit = units.get(name.rsplit("/", 1)[-1]) if "/data/" in name else None
        if unit and unit > 1:  # what a big-endian host's torch.save writes
            return b"".join(data[i:i + unit][::-1] for i in range(0, len(data), unit))
        return data
    made.append(_rewrite_zip(source, directory / "byteorder_big.pt", big))
    made.append(_rewrite_zip(source, directory / "byteorder_little.pt",
                             lambda n, d: b"little" if n.endswith("/byteorder") else d))
    made.append(_rewrite_zip(source, directory / "byteorder_missing.pt",
                             lambda n, d: None if n.endswith("/byteorder") else d))
    source.unlink()
    return made


def _storage_units(path: Path) -> dict[str, int]:
    """Storage key -> the unit torch swaps it by (element size; a complex part; 1 for an untyped storage)."""
    sizes: dict[str, int] = {}
    with zipfile.ZipFile(path) as archive:
        pkl = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        data = archive.read(pkl)

    class Reader(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            _, storage_type, key, _, _ = pid
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            size = torch._utils._element_size(dtype)
            sizes[key] = size // 2 if dtype.is_complex else size
            return torch.UntypedStorage(0)

        def find_class(self, module: str, name: str) -> Any:
            if name.startswith("_rebuild"):
                return lambda *a, **k: None
            return super().find_class(module, name)

    Reader(io.BytesIO(data)).load()
    return sizes


# test_serialization_zipfile_*: archive names, CRC-off saves, in-memory buffers, mmap-aligned saves
def zipvariants(directory: Path) -> list[Path]:
    obj = {"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.int64)}
    made = [_save(directory / "zip_plain.pt", obj)]
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    (directory / "zip_from_buffer.bin").write_bytes(buffer.getvalue())
    made.append(directory / "zip_from_buffer.bin")
    torch.serialization.set_crc32_options(False)
    try:
        made.append(_save(directory / "zip_crc_off.pt", obj))
    finally:
        torch.serialization.set_crc32_options(True)
    # test_serialization_zipfile with a name: the archive folder is the name the file was saved under
    saved_as = _save(directory / "saved_as.pt", obj)
    if saved_as is not None:
        made.append(saved_as.rename(directory / "zip_renamed.pt"))
    made.append(_save(directory / "zip_unicode_modèle.pt", obj))
    made.append(_save(directory / "zip_many_storages.pt", {f"layer{i}.weight": torch.full((i + 1,), float(i))
                                                          for i in range(40)}))
    return [x for x in made if x]


# rebuild functions torch's weights_only unpickler allows beyond _rebuild_tensor_v2
def rebuilds(directory: Path) -> list[Path]:
    made: list[Path] = []
    meta = torch.empty(2, 3, device="meta")
    made.append(_save(directory / "rebuild_meta.pt", {"m": meta, "w": torch.ones(2)}))
    v3 = Crafted(torch._utils._rebuild_tensor_v3, (torch.arange(4.0)._typed_storage(), 0, (2, 2), (2, 1), False,
                                                   OrderedDict(), torch.float32))
    made.append(_save(directory / "rebuild_v3.pt", {"w": v3}))
    attributed = torch.arange(3.0)
    attributed.note = "hello"  # a Python attribute: torch.save writes _rebuild_from_type_v2
    made.append(_save(directory / "rebuild_from_type_v2.pt", {"w": attributed}))
    cpu = Crafted(torch._utils._rebuild_device_tensor_from_cpu_tensor, (torch.arange(3.0), torch.float32,
                                                                        "cpu", False))
    made.append(_save(directory / "rebuild_device_from_cpu.pt", {"w": cpu}))
    return [x for x in made if x]


def _quantized_weights() -> torch.Tensor:
    return torch.linspace(-3.0, 5.0, 24).reshape(4, 6)


def _per_channel(dtype: torch.dtype, axis: int = 0, floating: bool = False) -> torch.Tensor:
    count = 4 if axis == 0 else 6
    scales = torch.linspace(0.05, 0.4, count, dtype=torch.float32 if floating else torch.float64)
    zero_points = torch.linspace(0.5, 3.5, count) if floating else torch.arange(count)
    return torch.quantize_per_channel(_quantized_weights(), scales, zero_points, axis, dtype)


def _quantized_files() -> dict[str, Callable[[], dict]]:
    weights = _quantized_weights()
    return {
        "quant_per_tensor": lambda: {"q": torch.quantize_per_tensor(torch.arange(6.0), 0.5, 2, torch.quint8)},
        "quant_per_channel": lambda: {"q": torch.quantize_per_channel(
            torch.arange(6.0).reshape(2, 3), torch.tensor([0.5, 1.0]), torch.tensor([0, 1]), 0, torch.qint8)},
        # every quantized dtype (test_serialization_qint*, quint4x2 and quint2x4 are packed sub-byte types)
        "quant_dtypes": lambda: {str(dtype).removeprefix("torch."): torch.quantize_per_tensor(weights, 0.1, 3, dtype)
                                 for dtype in (torch.quint8, torch.qint8, torch.qint32, torch.quint4x2,
                                               torch.quint2x4)},
        "quant_per_channel_axes": lambda: {"a0": _per_channel(torch.qint8), "a1": _per_channel(torch.quint8, 1),
                                           "i32": _per_channel(torch.qint32, 1)},
        "quant_float_qparams": lambda: {"u8": _per_channel(torch.quint8, floating=True),
                                        "u4": _per_channel(torch.quint4x2, floating=True),
                                        "u2": _per_channel(torch.quint2x4, floating=True)},
        # views of one quantized storage: a slice and the tensor share it, a transpose
        "quant_views": lambda: (lambda full: {"full": full, "slice": full[1:3, 2:5],
                                              "pt_t": torch.quantize_per_tensor(weights, 0.1, 3, torch.qint32).t()})(
            _per_channel(torch.qint8)),
        "quant_with_dense": lambda: {"fc.weight": _per_channel(torch.qint8), "fc.bias": torch.linspace(-1, 1, 4),
                                     "steps": torch.tensor(7)},
        # wrapped as torch.save wraps any tensor: a Parameter (with state), Python attributes
        "quant_parameter": lambda: {"p": torch.nn.Parameter(_per_channel(torch.qint8), requires_grad=False),
                                    "s": _with_attributes(torch.nn.Parameter(
                                        torch.quantize_per_tensor(weights, 0.1, 3, torch.quint8), requires_grad=False))},
        "quant_attributes": lambda: {"q": _with_attributes(torch.quantize_per_tensor(weights, 0.1, 3, torch.qint8))},
    }


def _with_attributes(tensor: torch.Tensor) -> torch.Tensor:
    tensor.note = "calibrated"  # a plain Python attribute: torch.save writes it as state
    return tensor


# test_serialization_quantized / qtensor: per-tensor and per-channel schemes, every quantized dtype, views,
# the legacy format
def quantized(directory: Path) -> list[Path]:
    made = [_save(directory / f"{name}.pt", make()) for name, make in _quantized_files().items()]
    made.append(_save(directory / "quant_legacy.pt", {"pt": torch.quantize_per_tensor(_quantized_weights(), 0.1, 3,
                                                                                     torch.quint8),
                                                      "pc": _per_channel(torch.qint8, 1)},
                      _use_new_zipfile_serialization=False))
    return [x for x in made if x]


def _dense() -> torch.Tensor:
    return torch.tensor([[0.0, 1.5, 0.0, -2.0], [3.0, 0.0, 0.0, 4.25], [0.0, 0.0, 0.0, 0.0], [5.0, 6.0, 0.0, -0.0]])


# test_serialization_sparse, _sparse_csr/_csc/_bsr/_bsc (test_serialization_sparse_compressed), hybrid and
# uncoalesced COO, the legacy format
def sparse(directory: Path) -> list[Path]:
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2))
    dense = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    uncoalesced = torch.sparse_coo_tensor(torch.tensor([[1, 0, 1], [2, 0, 2]]), torch.tensor([1.0, 2.0, 3.0]), (2, 3))
    made = [_save(directory / "sparse_coo.pt", {"s": coo}), _save(directory / "sparse_csr.pt", {"s": dense.to_sparse_csr()}),
            _save(directory / "sparse_layouts.pt", {"coo": _dense().to_sparse(), "csr": _dense().to_sparse_csr(),
                                                    "csc": _dense().double().to_sparse_csc(),
                                                    "bsr": _dense().to_sparse_bsr((2, 2)),
                                                    "bsc": _dense().to_sparse_bsc((2, 1))}),
            _save(directory / "sparse_coo_kinds.pt", {"uncoalesced": uncoalesced,
                                                      "hybrid": torch.arange(24).reshape(4, 3, 2).to_sparse(1),
                                                      "empty": torch.zeros(3, 3).to_sparse(),
                                                      "dense": torch.ones(2)}),
            _save(directory / "sparse_legacy.pt", {"coo": _dense().to_sparse(), "w": torch.ones(2)},
                  _use_new_zipfile_serialization=False),
            _save(directory / "sparse_wrapped.pt", {"p": torch.nn.Parameter(_dense().to_sparse(), requires_grad=False),
                                                    "a": _with_attributes(_dense().to_sparse_csr())})]
    return [x for x in made if x]


# test_serialization_nested_tensor: float and integer pieces of one and two dimensions
def nested(directory: Path) -> list[Path]:
    nt = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)])
    made = [_save(directory / "nested.pt", {"n": nt}),
            _save(directory / "nested_kinds.pt", {
                "grid": torch.nested.nested_tensor([torch.ones(2, 3), torch.arange(8.0).reshape(4, 2)]),
                "ints": torch.nested.nested_tensor([torch.arange(3), torch.arange(5)]),
                "w": torch.ones(3)}),
            _save(directory / "nested_attributes.pt", {"n": _with_attributes(torch.nested.nested_tensor(
                [torch.ones(2), torch.arange(3.0)]))})]
    return [x for x in made if x]


FAMILIES: dict[str, Callable[[Path], list[Path]]] = {
    "dtypes": dtypes, "views": views, "parameters": parameters, "conj/neg bits": conjneg,
    "containers": containers, "storages": storages, "serialization data": serialization_data, "protocols": protocols, "legacy": legacy,
    "legacy records": legacy_records, "byte order": byteorder, "zip variants": zipvariants, "rebuilds": rebuilds,
    "quantized": quantized, "sparse": sparse, "nested": nested,
}


def build(directory: Path) -> dict[str, list[Path]]:
    """Every family's files, written into ``directory``."""
    found: dict[str, list[Path]] = {}
    for family, make in FAMILIES.items():
        folder = directory / family.replace("/", "_").replace(" ", "_")
        folder.mkdir(parents=True, exist_ok=True)
        found[family] = make(folder)
    return found
