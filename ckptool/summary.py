"""inspect: what a checkpoint holds, as plain data (rendered by the CLI). Reads no tensor bytes."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import formats, layouts, modules, suggest
from .checkpoint import Checkpoint, spell_weights
from .errors import InputError
from .digest import fingerprint
from .pickles import OpaqueObject
from .reader import load
from .refs import DeviceRef, SizeRef, TensorRef, check_expansion, expansion
from .tree import iter_tensors

_WRAPPER_NAMES = {"module.": "DataParallel/DDP", "_orig_mod.": "torch.compile", "model.": "Lightning"}


@dataclass
class Hint:
    """A problem found in the checkpoint and the command that fixes it."""

    problem: str
    fix: str


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: list[int]
    bytes: int
    device: str


@dataclass
class Summary:
    """Everything ``ckptool inspect`` reports; ``asdict`` gives the --json object."""

    path: str
    format: str
    layout: list[Any] | None
    prefix: str
    tensors: int
    parameters: int
    bytes: int
    dtypes: dict[str, int]
    saved_devices: dict[str, int]
    tied: list[list[str]]
    entries: dict[str, str]
    globals: list[str]
    file_bytes: int
    metadata: dict[str, str] = field(default_factory=dict)
    hints: list[Hint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fingerprint: str | None = None
    tensor_list: list[TensorInfo] | None = None
    # every set of weights the container holds: {"weights": PATH as the weights option takes it,
    # "layout", "kind", "module_class", "tensors", "chosen"}; the chosen one is what the rest describes
    candidates: list[dict[str, Any]] = field(default_factory=list)
    module_class: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.tensor_list is None:
            data.pop("tensor_list")
        if self.fingerprint is None:
            data.pop("fingerprint")
        return data


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{size} B"


def describe_entry(value: Any) -> str:
    """A one-line description of a container entry that is not the weights."""
    if isinstance(value, bool | int | float | str) or value is None:
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    if isinstance(value, TensorRef):
        return f"tensor {value.dtype.name}{list(value.shape)}"
    if isinstance(value, DeviceRef):
        return f"device {value}"
    if isinstance(value, SizeRef):
        return f"torch.Size({list(value)})"
    if modules.is_module(value):  # a second pickled model (an EMA copy): its weights as state_dict() lists them
        try:
            return f"whole-model pickle {value.global_name}, {len(modules.state_dict(value))} tensors"
        except InputError:
            return f"whole-model pickle {value.global_name}, unreadable"
    tensors = list(iter_tensors(value))
    if is_optimizer_state(value):
        return describe_optimizer_state(value)
    if tensors:
        return f"{type(value).__name__} with {len(tensors)} tensors, {_human_bytes(sum(t.nbytes for _, t in tensors))}"
    if isinstance(value, OpaqueObject):
        return f"{value.global_name} object"
    if isinstance(value, dict):
        text = repr(value) if all(isinstance(v, bool | int | float | str | type(None)) for v in dict.values(value)) else ""
        return text if text and len(text) <= 80 else f"dict with {len(value)} entries"
    if isinstance(value, list | tuple):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def is_optimizer_state(value: Any) -> bool:
    """An ``optimizer.state_dict()``: ``{"state": {index: {...}}, "param_groups": [...]}``."""
    return isinstance(value, dict) and isinstance(dict.get(value, "state"), dict) \
        and isinstance(dict.get(value, "param_groups"), list)


def describe_optimizer_state(value: dict) -> str:
    """``optimizer state: 2 params over 1 parameter group, 6 tensors (per parameter: exp_avg, exp_avg_sq,
    step), 104 B`` — what an optimizer's own state_dict holds, named by torch's per-parameter keys."""
    state = dict.get(value, "state")
    groups = len(dict.get(value, "param_groups"))
    tensors = [tensor for _, tensor in iter_tensors(value)]
    names: list[str] = []
    for per_parameter in dict.values(state):
        if isinstance(per_parameter, dict):
            names += [str(key) for key in per_parameter if str(key) not in names]
    kinds = f" (per parameter: {', '.join(names[:6])}{', ...' if len(names) > 6 else ''})" if names else ""
    return (f"optimizer state: {len(state)} params over {groups} parameter group{'s' if groups != 1 else ''}, "
            f"{len(tensors)} tensors{kinds}, {_human_bytes(sum(t.nbytes for t in tensors))}")


def tied_groups(tensors: dict[str, TensorRef]) -> list[list[str]]:
    """Groups (≥2) of weight names that share one storage."""
    groups: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        groups.setdefault(id(tensor.storage), []).append(name)
    return sorted(sorted(names) for names in groups.values() if len(names) > 1)


def _hints(checkpoint: Checkpoint, summary: Summary) -> list[Hint]:
    path = checkpoint.path  # as given: the commands run from where inspect was run
    fmt = formats.for_name(checkpoint.format)
    hints: list[Hint] = []
    if summary.prefix:
        wrappers = " + ".join(_WRAPPER_NAMES.get(p + ".", p) for p in summary.prefix.rstrip(".").split(".") if p)
        hints.append(Hint(f'keys carry "{summary.prefix}" ({wrappers}); a bare model reports them as unexpected keys',
                          suggest.strip(path, format_=checkpoint.format, allow_globals=checkpoint.allow_globals)))
    gpu = sorted(tag for tag in summary.saved_devices if tag != "cpu")
    if gpu:
        hints.append(Hint(f"saved on {', '.join(gpu)}: torch.load fails on a machine without that GPU",
                          suggest.remap_to_cpu(path, allow_globals=checkpoint.allow_globals)))
    extra = [g for g in summary.globals if not g.startswith(("torch.", "collections.", "_codecs.", "builtins."))]
    if fmt.torch_load_refuses:  # then its globals are its own metadata's (DCP's), read as inert records
        hints.append(Hint(fmt.torch_load_refuses, suggest.to_safetensors(path, allow_globals=checkpoint.allow_globals)))
    elif extra:
        hints.append(Hint(f"pickle uses {', '.join(extra)}: torch.load(weights_only=True) refuses it",
                          suggest.to_safetensors(path, allow_globals=checkpoint.allow_globals)))
    if checkpoint.layout is None and is_optimizer_state(checkpoint.container):
        hints.append(Hint("no model weights: this file is " + describe_optimizer_state(checkpoint.container),
                          "the model's weights are saved beside it (e.g. model.safetensors, pytorch_model.bin); "
                          "keep this file for resuming training"))
    elif checkpoint.layout is None:
        hints.append(Hint("no weights found (no mapping of names to tensors)", "check that this is a model checkpoint"))
    return hints


def weight_candidates(checkpoint: Checkpoint) -> list[dict[str, Any]]:
    """Every set of weights in the container, the chosen one marked (a state dict's tensors counted,
    a pickled module's read as its state dict; one that cannot be read has ``tensors`` None and a ``problem``)."""
    if formats.for_name(checkpoint.format).weights_only:
        return []
    found: list[dict[str, Any]] = []
    for weight_set in checkpoint.weight_sets():
        entry: dict[str, Any] = {"weights": spell_weights(checkpoint.container, weight_set.layout),
                                 "layout": list(weight_set.layout), "kind": weight_set.kind,
                                 "module_class": weight_set.module_class, "tensors": None,
                                 "chosen": weight_set.layout == checkpoint.layout}
        try:
            chosen = checkpoint if entry["chosen"] else checkpoint.select_weights(weight_set.layout)
            entry["tensors"] = len(chosen.tensors)
        except InputError as e:
            entry["problem"] = e.message
        found.append(entry)
    return found


def _loose_tensors_note(checkpoint: Checkpoint) -> list[str]:
    """What a file without a mapping of names to weights holds instead (a bare tensor, a list...)."""
    try:
        loose = checkpoint.tensors_by_place()
    except InputError:
        return []
    shown = ", ".join(repr(name) for name in list(loose)[:3]) + (", ..." if len(loose) > 3 else "")
    return [f"{len(loose)} tensor(s) outside any mapping of names, by place: {shown} — diff compares them "
            "by place"]


def summarize(checkpoint: Checkpoint, *, with_fingerprint: bool = False, with_tensors: bool = False,
              allow_expansion: bool = False) -> Summary:
    """Describe a loaded checkpoint (no tensor bytes read unless ``with_fingerprint``)."""
    tensors = checkpoint.tensors if checkpoint.has_weights else {}
    dtype_counts = Counter(t.dtype.name for t in tensors.values())
    file_bytes = 0
    for file in checkpoint.files:
        try:
            file_bytes += os.path.getsize(file)
        except OSError:
            pass
    summary = Summary(
        path=str(checkpoint.path),
        format=checkpoint.format,
        layout=list(checkpoint.layout) if checkpoint.layout is not None else None,
        prefix=checkpoint.prefix,
        tensors=len(tensors),
        parameters=sum(t.numel for t in tensors.values()),
        bytes=sum(t.nbytes for t in tensors.values()),
        dtypes=dict(sorted(dtype_counts.items())),
        # a format without location tags (safetensors) loads everything where the reader asks
        saved_devices=dict(sorted(checkpoint.saved_devices().items()))
        if formats.for_name(checkpoint.format).has_location_tags else {},
        tied=tied_groups(tensors),
        entries={str(k): describe_entry(v) for k, v in checkpoint.entries().items()},
        globals=sorted(checkpoint.globals),
        file_bytes=file_bytes,
        metadata=dict(checkpoint.metadata),
        notes=list(checkpoint.notes),
    )
    summary.module_class = checkpoint.module_class
    summary.candidates = weight_candidates(checkpoint)
    with_bits = [name for name, t in tensors.items() if t.conj or t.neg]
    if with_bits:  # the stored bytes are not the values: say so, since nothing else shows it
        summary.notes.append(f"{len(with_bits)} tensor(s) saved with a conjugate or negative bit ({with_bits[0]!r}"
                             f"{', ...' if len(with_bits) > 1 else ''}): their values are the stored bytes "
                             "conjugated/negated, as torch.load gives them")
    summary.notes += layouts.describe_all(checkpoint.state_dict if checkpoint.has_weights else {})
    if not checkpoint.has_weights:
        summary.notes += _loose_tensors_note(checkpoint)
    summary.hints = _hints(checkpoint, summary)
    measured = expansion(tensors)
    if measured.expanding:
        name, view_bytes, span = measured.expanding[0]
        summary.notes.append(f"{len(measured.expanding)} tensor view(s) expand their storage (stride 0 or overlapping): "
                             f"{_human_bytes(measured.stored)} stored, {_human_bytes(measured.logical)} in full "
                             f"(largest {name!r}: {_human_bytes(span)} viewed as {_human_bytes(view_bytes)})")
    if with_fingerprint:
        check_expansion(tensors, allow=allow_expansion, path=checkpoint.path, doing="hash")
        summary.fingerprint = fingerprint(tensors, allow_expansion=True)
    if with_tensors:
        summary.tensor_list = [TensorInfo(name, t.dtype.name, list(t.shape), t.nbytes, t.location)
                               for name, t in tensors.items()]
    return summary


def inspect(path: Path | str, *, allow_globals: tuple[str, ...] | list[str] = (), fingerprint: bool = False,
            tensors: bool = False, allow_expansion: bool = False, weights: str | None = None) -> Summary:
    """Describe any checkpoint without running its code or reading its tensor bytes.

    Example:
        >>> s = ckptool.inspect("ddp.pt")        # doctest: +SKIP
        >>> s.format, s.layout, s.prefix, s.saved_devices   # doctest: +SKIP
        ('torch-zip', ['model'], 'module.', {'cpu': 10})
    """
    checkpoint = load(path, allow_globals=allow_globals, weights=weights)
    return summarize(checkpoint, with_fingerprint=fingerprint, with_tensors=tensors, allow_expansion=allow_expansion)
