"""inspect: what a checkpoint holds, as plain data (rendered by the CLI). Reads no tensor bytes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from operator import attrgetter, mul
from pathlib import Path
from typing import Any

from ckptool import formats
from ckptool.base import suggest
from ckptool.base.errors import InputError
from ckptool.base.gcpause import keep
from ckptool.base.text import value_str
from ckptool.files.byteio import path_size, use_storage_options
from ckptool.io.reader import load
from ckptool.model import optimizers
from ckptool.model.checkpoint import Checkpoint, spell_weights
from ckptool.model.describe import describe_optimizer_state, entry_record, human_bytes, is_optimizer_state
from ckptool.ops.tensor_groups import ModuleTotal, TensorGroup, component_totals, group_tensors, module_totals
from ckptool.pickles import OpaqueObject, layouts
from ckptool.tensors.refs import PartRef, TensorRef, census, check_expansion, expansion, shared_storages

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
class WeightInfo:
    """One key of the weights as torch's state dict holds it: a dense tensor, a sparse, nested or
    quantized tensor whole (``parts``: the names diff and the fingerprint give its parts), or a meta
    tensor (device ``meta``: a shape and dtype, no values, no bytes).

    ``layout`` is ``strided``, ``sparse_coo``, ``sparse_csr``, ``sparse_csc``, ``sparse_bsr``,
    ``sparse_bsc``, ``nested`` or ``quantized`` (``qscheme`` then says which); ``shape`` is a sparse
    tensor's size, and for a nested tensor the number of its pieces followed by ``None`` for each of
    their dimensions (their sizes vary by piece and are not read); ``bytes`` sums its parts' bytes.
    """

    name: str
    layout: str
    dtype: str
    shape: list[int | None]
    bytes: int
    device: str
    parts: list[str] | None = None
    qscheme: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for optional in ("parts", "qscheme"):
            if data[optional] is None:
                data.pop(optional)
        return data


META_REBUILD = "torch._utils._rebuild_meta_tensor_no_storage"


def weight_records(state_dict: Mapping[Any, Any]) -> list[WeightInfo]:
    """Every tensor among the weights by its key, in order, as torch's state dict holds it (no bytes read)."""
    from ckptool.tensors.dtypes import BY_TORCH_NAME

    records = []
    items = dict.items(state_dict) if isinstance(state_dict, dict) else state_dict.items()
    for key, value in items:
        name = key if isinstance(key, str) else value_str(key)
        if isinstance(value, TensorRef):
            records.append(
                WeightInfo(name, "strided", value.dtype.name, list(value.shape), value.nbytes, value.location)
            )
        elif isinstance(value, layouts.LayoutTensor):
            parts = value.components()
            whole = value
            while isinstance(whole, layouts.WrappedLayoutTensor):
                whole = whole.inner
            shape: list[int | None] = (
                [value.shape[0], *[None] * value.shape[1]] if value.layout == "nested" else list(value.shape)
            )
            records.append(
                WeightInfo(
                    name,
                    value.layout,
                    value.dtype.name,
                    shape,
                    sum(part.nbytes for _, part in parts),
                    parts[0][1].location if parts else "",
                    # (a key that is no string names no parts: Checkpoint.tensors leaves them out)
                    parts=[layouts.component_name(key, value, role) for role, _ in parts]
                    if isinstance(key, str)
                    else [],
                    qscheme=whole.qscheme() if hasattr(whole, "qscheme") else None,
                )
            )
        elif isinstance(value, OpaqueObject) and value.global_name == META_REBUILD:
            dtype, size = value.reduce_args()[:2]
            records.append(WeightInfo(name, "strided", BY_TORCH_NAME[dtype.name].name, list(size), 0, "meta"))
    return records


def _meta_note(state_dict: Mapping[Any, Any]) -> list[str]:
    """The meta tensors among the weights: listed nowhere else (they have no values to count)."""
    items = dict.items(state_dict) if isinstance(state_dict, dict) else state_dict.items()
    names = [key for key, value in items if isinstance(value, OpaqueObject) and value.global_name == META_REBUILD]
    if not names:
        return []
    shown = ", ".join(repr(name) for name in names[:3]) + (", ..." if len(names) > 3 else "")
    return [
        f"{len(names)} meta tensor(s), a shape and dtype without values: {shown} — torch.load gives them on the "
        "meta device; not among the tensors counted above (the tensor listing shows them)"
    ]


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
    # each entry that is not the weights: {"type", "summary", "value" (when it is plain data), "global"}
    entries: dict[str, dict[str, Any]]
    globals: list[str]
    file_bytes: int
    metadata: dict[str, str] = field(default_factory=dict)
    hints: list[Hint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fingerprint: str | None = None
    # with --tensors: every tensor as Checkpoint.tensors lists it (a sparse, nested or quantized one as its parts,
    # the names diff and the fingerprint use), and every key of the weights as torch's state dict holds it
    tensor_list: list[TensorInfo] | None = None
    state_dict: list[WeightInfo] | None = None
    # every set of weights the container holds: {"weights": PATH as the weights option takes it,
    # "layout", "kind", "module_class", "tensors", "chosen"}; the chosen one is what the rest describes
    candidates: list[dict[str, Any]] = field(default_factory=list)
    module_class: str | None = None
    # a training folder input: its kind, weights files, the step reached and every other file,
    # each with a line saying what it holds (training_state.FolderState); None for any other input
    training_folder: Any = None
    # the weights' tensors, elements and bytes per top-level module (the first component of a key after the
    # wrapper prefix), first met first; keys named "component/key" (a model folder's) by component, then
    # module, each row with its component, and summed per component in ``components`` (else empty)
    modules: list[ModuleTotal] = field(default_factory=list)
    components: list[ModuleTotal] = field(default_factory=list)

    def tensor_groups(self) -> list[TensorGroup]:
        """With --tensors: the listing's rows, repeated blocks grouped (``tensor_groups.group_tensors`` of
        ``state_dict``: 100,000 keys in ~0.2 s). Not in --json, which lists every key."""
        return group_tensors(self.state_dict) if self.state_dict is not None else []

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["modules"] = [module.to_json() for module in self.modules]
        data["components"] = [component.to_json() for component in self.components]
        if self.tensor_list is None:
            data.pop("tensor_list")
        if self.state_dict is None:
            data.pop("state_dict")
        else:
            data["state_dict"] = [record.to_json() for record in self.state_dict]
        if self.training_folder is None:
            data.pop("training_folder")
        if self.fingerprint is None:
            data.pop("fingerprint")
        return data


def tied_groups(tensors: dict[str, TensorRef]) -> list[list[str]]:
    """Groups (≥2) of weight names that share one storage."""
    groups: dict[int, list[str]] = {}
    shared = shared_storages(tensors.values())
    if not shared:
        return []
    for name, tensor in tensors.items():
        if id(tensor.storage) in shared:
            groups.setdefault(id(tensor.storage), []).append(name)
    return sorted(sorted(names) for names in groups.values() if len(names) > 1)


def _hints(checkpoint: Checkpoint, summary: Summary) -> list[Hint]:
    path = checkpoint.path  # as given: the commands run from where inspect was run
    fmt = formats.for_name(checkpoint.format)
    hints: list[Hint] = []
    gpu = sorted(tag for tag in summary.saved_devices if tag != "cpu")
    on_gpu = f"saved on {', '.join(gpu)}: torch.load fails on a machine without that GPU"
    if checkpoint.folder is not None and checkpoint.folder.composite:  # a folder's rewrite is its convert
        if gpu:
            out = path.parent / f"{path.name}-safetensors"  # (no suffix: a folder, written as the same tree)
            hints.append(
                Hint(
                    on_gpu + " (safetensors records no device)",
                    suggest.command("convert", path, out=out, allow_globals=list(checkpoint.allow_globals)),
                )
            )
        return hints + _folder_hints(checkpoint, summary)
    if summary.prefix:
        wrappers = " + ".join(_WRAPPER_NAMES.get(p + ".", p) for p in summary.prefix.rstrip(".").split(".") if p)
        carry = f'keys carry "{summary.prefix}" ({wrappers}); a bare model reports them as unexpected keys'
        # both at once: one write fixes both (two commands in turn would leave two half-fixed files)
        hints.append(
            Hint(
                carry + (f"; {on_gpu}" if gpu else ""),
                suggest.strip(
                    path,
                    suffix=formats.for_name(checkpoint.format).default_suffix,
                    allow_globals=checkpoint.allow_globals,
                    to_cpu=bool(gpu),
                ),
            )
        )
    elif gpu:
        hints.append(Hint(on_gpu, suggest.remap_to_cpu(path, allow_globals=checkpoint.allow_globals)))
    extra = [g for g in summary.globals if not g.startswith(("torch.", "collections.", "_codecs.", "builtins."))]
    # convert writes named weights: without them it refuses, so it is no fix (the hints below say what is there)
    if checkpoint.has_weights and fmt.torch_load_refuses:  # its globals are its metadata's (DCP's), inert records
        hints.append(Hint(fmt.torch_load_refuses, suggest.to_safetensors(path, allow_globals=checkpoint.allow_globals)))
    elif checkpoint.has_weights and extra:
        hints.append(
            Hint(
                f"pickle uses {', '.join(extra)}: torch.load(weights_only=True) refuses it",
                suggest.to_safetensors(path, allow_globals=checkpoint.allow_globals),
            )
        )
    if checkpoint.folder is not None:
        hints += _folder_hints(checkpoint, summary)
    elif checkpoint.layout is None and is_optimizer_state(checkpoint.container):
        hints.append(
            Hint(
                "no model weights: this file is " + describe_optimizer_state(checkpoint.container) + "; "
                "the model's weights are saved beside it (e.g. model.safetensors, pytorch_model.bin) — "
                "keep this file for resuming training; its tensors as safetensors:",
                suggest.optimizer_to_safetensors(path, allow_globals=checkpoint.allow_globals),
            )
        )
    elif checkpoint.layout is None:
        from ckptool.ops.training_state import describe_content

        what = describe_content(checkpoint.container)
        if what is not None:  # a training run's other part (a scheduler's, the rng's state)
            hints.append(
                Hint(
                    f"no model weights: this file is a training run's {what}",
                    "keep it for resuming training; the model's weights are saved beside it "
                    "(e.g. model.safetensors, pytorch_model.bin)",
                )
            )
        else:
            hints.append(
                Hint("no weights found (no mapping of names to tensors)", "check that this is a model checkpoint")
            )
    return hints


def _folder_hints(checkpoint: Checkpoint, summary: Summary) -> list[Hint]:
    """A training folder's: files that need trust to be described, or name code-running globals;
    no model weights at all."""
    hints: list[Hint] = []
    state = summary.training_folder
    folder = checkpoint.path
    for file in state.files if state is not None else []:
        if file.dangerous:
            hints.append(
                Hint(
                    f"{file.file} names globals known to run code ({', '.join(file.dangerous[:4])}): "
                    "torch.load of it would run them — do not resume from this folder unless you trust "
                    "where it came from",
                    suggest.command("scan", folder),
                )
            )
        elif file.needs:
            shown = ", ".join(file.needs[:3]) + (", ..." if len(file.needs) > 3 else "")
            # one pattern per package (a pattern never allows a code-running global)
            allowed = [*checkpoint.allow_globals, *dict.fromkeys(f"{name.split('.', 1)[0]}.*" for name in file.needs)]
            hints.append(
                Hint(
                    f"{file.file} pickles {shown} (another package's classes; torch.load would import "
                    "and run them): the weights read without them; to see what it holds, if you trust it",
                    suggest.command("inspect", folder, allow_globals=allowed),
                )
            )
    if checkpoint.layout is None:
        from ckptool.formats.training_folder import OPTIMIZER  # a folder's roles: imported where a folder is read

        optimizer = [file for file in state.files if file.role == OPTIMIZER] if state is not None else []
        if optimizer:
            hints.append(
                Hint(
                    "no model weights in this folder (no model.safetensors, pytorch_model.bin or their "
                    "index); the optimizer's tensors as safetensors:",
                    suggest.optimizer_to_safetensors(folder, folder=True, allow_globals=checkpoint.allow_globals),
                )
            )
        else:
            hints.append(
                Hint(
                    "no model weights in this folder (no model.safetensors, pytorch_model.bin or their index)",
                    "the weights are saved elsewhere (save_model / save_pretrained)",
                )
            )
    return hints


def _parts_of(folder: Any) -> list[Any]:
    """Each weights entry's component (None for a training folder's weights file)."""
    by_name = {part.name: part for part in folder.components}
    top = next((part for part in folder.components if not part.directory), None)
    found = []
    for file in folder.weights:
        part = by_name.get(file.name)
        if part is None and top is not None and file.name == top.path(folder.variant):
            part = top
        found.append(part)
    return found


def folder_candidates(checkpoint: Checkpoint, summary: Summary) -> list[dict[str, Any]]:
    """A training folder's sets of weights: each model's file, then each optimizer's state."""
    from ckptool.io.reader import load_member

    folder = checkpoint.folder
    found: list[dict[str, Any]] = []
    state = summary.training_folder
    parts = {part.name: part for part in state.components} if state is not None else {}
    for file, part in zip(folder.weights, _parts_of(folder)):
        entry: dict[str, Any] = {
            "weights": file.name,
            "layout": [],
            "kind": "state dict",
            "module_class": None,
            "tensors": None,
            "chosen": file.name == folder.read and not checkpoint.flattened,
            "file": file.name,
        }
        described = parts.get(part.name) if part is not None else None
        if described is not None:  # a component: read once already (ops.components)
            entry.update(
                weights=part.name if not part.directory else file.name,
                chosen=described.chosen and not checkpoint.flattened,
                tensors=described.tensors,
                file=described.file,
                component=part.name,
            )
            if described.problem is not None:
                entry["problem"] = described.problem
            found.append(entry)
            continue
        try:
            if entry["chosen"]:
                entry["tensors"] = len(checkpoint.tensors)
            else:
                entry["tensors"] = len(
                    load_member(folder.directory, file.name, allow_globals=checkpoint.allow_globals).tensors
                )
        except InputError as e:
            entry["problem"] = e.message
        found.append(entry)
    described = {file.file: file for file in state.files} if state is not None else {}
    from ckptool.formats.training_folder import OPTIMIZER

    for number, file in enumerate(folder.of_role(OPTIMIZER)):
        said = described.get(file.name)
        entry = {
            "weights": optimizers.STATE_KEY if number == 0 else file.name,
            "layout": [],
            "kind": "optimizer state",
            "module_class": None,
            "tensors": said.details.get("tensors") if said is not None else None,
            "chosen": file.name == folder.read and checkpoint.flattened,
            "file": file.name,
        }
        if entry["tensors"] is None and said is not None:
            entry["problem"] = said.problem or said.summary
        found.append(entry)
    return found


def weight_candidates(checkpoint: Checkpoint, chosen_tensors: int | None = None) -> list[dict[str, Any]]:
    """Every set of weights in the container, the chosen one marked (a state dict's tensors counted,
    a pickled module's read as its state dict; one that cannot be read has ``tensors`` None and a ``problem``).
    ``chosen_tensors``: the chosen set's count, where the caller has listed its tensors."""
    if formats.for_name(checkpoint.format).weights_only:
        return []
    found: list[dict[str, Any]] = []
    for weight_set in checkpoint.weight_sets():
        entry: dict[str, Any] = {
            "weights": weight_set.derived or spell_weights(checkpoint.container, weight_set.layout),
            "layout": list(weight_set.layout),
            "kind": weight_set.kind,
            "module_class": weight_set.module_class,
            "tensors": None,
            "chosen": weight_set.layout == checkpoint.layout and weight_set.derived == checkpoint.derived,
        }
        try:
            if entry["chosen"] and chosen_tensors is not None:
                entry["tensors"] = chosen_tensors
            else:
                named = weight_set.derived or weight_set.layout
                chosen = checkpoint if entry["chosen"] else checkpoint.select_weights(named)
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
    return [f"{len(loose)} tensor(s) outside any mapping of names, by place: {shown} — diff compares them by place"]


def tensor_totals(tensors: Mapping[Any, TensorRef], prefix: str) -> list[ModuleTotal]:
    """:func:`tensor_groups.module_totals` of the weights' tensors (a sparse or nested tensor's parts under
    the key they are parts of), in C-speed passes: 100,000 tensors in ~40 ms."""
    names = list(tensors)
    if set(map(type, names)) != {str}:
        names = [name if isinstance(name, str) else value_str(name) for name in names]
    views = list(tensors.values())
    if PartRef.made and PartRef in set(map(type, views)):  # a part is named "key[layout size/role]"
        names = [name.rpartition("[")[0] or name if type(view) is PartRef else name for name, view in zip(names, views)]
    parameters = list(map(math.prod, map(_SHAPE, views)))
    return module_totals(names, parameters, list(map(mul, parameters, map(_ITEMSIZE, views))), prefix=prefix)


_SHAPE = attrgetter("shape")
_ITEMSIZE = attrgetter("dtype.itemsize")


def summarize(
    checkpoint: Checkpoint, *, with_fingerprint: bool = False, with_tensors: bool = False, allow_expansion: bool = False
) -> Summary:
    """Describe a loaded checkpoint (no tensor bytes read unless ``with_fingerprint``)."""
    tensors = checkpoint.tensors if checkpoint.has_weights else {}
    counted = census(list(tensors.values()))  # one C pass where built (100,000 tensors: ~10 ms)
    file_bytes = 0
    for file in checkpoint.files:
        try:
            file_bytes += path_size(file, learnt=True)
        except (OSError, InputError):
            pass
    summary = Summary(
        path=str(checkpoint.path),
        format=checkpoint.format,
        layout=list(checkpoint.layout) if checkpoint.layout is not None else None,
        prefix=checkpoint.prefix_among(tensors),
        tensors=len(tensors),
        parameters=counted.parameters,
        bytes=counted.nbytes,
        dtypes=dict(sorted(counted.dtypes.items())),
        # a format without location tags (safetensors) loads everything where the reader asks
        saved_devices=dict(sorted(checkpoint.saved_devices().items()))
        if formats.for_name(checkpoint.format).has_location_tags
        else {},
        tied=tied_groups(tensors) if counted.shared else [],
        entries={value_str(k): entry_record(v) for k, v in checkpoint.entries().items()},
        globals=sorted(checkpoint.globals),
        file_bytes=file_bytes,
        metadata=dict(checkpoint.metadata),
        notes=list(checkpoint.notes),
    )
    summary.module_class = checkpoint.module_class
    summary.modules = tensor_totals(tensors, summary.prefix)
    summary.components = component_totals(summary.modules)
    if checkpoint.folder is not None:
        from ckptool.ops.training_state import describe_folder

        summary.training_folder = describe_folder(checkpoint.folder, checkpoint.allow_globals)
        summary.candidates = folder_candidates(checkpoint, summary)
    else:
        summary.candidates = weight_candidates(checkpoint, len(tensors))
    with_bits = [name for name, t in tensors.items() if t.conj or t.neg] if counted.bits else []
    if with_bits:  # the stored bytes are not the values: say so, since nothing else shows it
        summary.notes.append(
            f"{len(with_bits)} tensor(s) saved with a conjugate or negative bit ({with_bits[0]!r}"
            f"{', ...' if len(with_bits) > 1 else ''}): their values are the stored bytes "
            "conjugated/negated, as torch.load gives them"
        )
    summary.notes += layouts.describe_all(checkpoint.state_dict if checkpoint.has_weights else {})
    summary.notes += _meta_note(checkpoint.state_dict if checkpoint.has_weights else {})
    if not checkpoint.has_weights:
        summary.notes += _loose_tensors_note(checkpoint)
    summary.hints = _hints(checkpoint, summary)
    measured = expansion(tensors, shared=counted.shared)
    if measured.expanding:
        name, view_bytes, span = measured.expanding[0]
        summary.notes.append(
            f"{len(measured.expanding)} tensor view(s) expand their storage (stride 0 or overlapping): "
            f"{human_bytes(measured.stored)} stored, {human_bytes(measured.logical)} in full "
            f"(largest {name!r}: {human_bytes(span)} viewed as {human_bytes(view_bytes)})"
        )
    if with_fingerprint:
        check_expansion(tensors, allow=allow_expansion, path=checkpoint.path, doing="hash")
        from ckptool.tensors.digest import fingerprint  # here: hashlib is 5-13 ms of a command that does not hash

        summary.fingerprint = fingerprint(tensors, allow_expansion=True)
    if with_tensors:
        summary.tensor_list = [
            TensorInfo(
                name if isinstance(name, str) else value_str(name), t.dtype.name, list(t.shape), t.nbytes, t.location
            )
            for name, t in tensors.items()
        ]
        summary.state_dict = weight_records(checkpoint.state_dict if checkpoint.has_weights else {})
    return summary


def inspect(
    path: Path | str,
    *,
    allow_globals: tuple[str, ...] | list[str] = (),
    fingerprint: bool = False,
    tensors: bool = False,
    allow_expansion: bool = False,
    weights: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    variant: str | None = None,
) -> Summary:
    """Describe any checkpoint without running its code or reading its tensor bytes.

    Example:
        >>> s = ckptool.inspect("ddp.pt")        # doctest: +SKIP
        >>> s.format, s.layout, s.prefix, s.saved_devices   # doctest: +SKIP
        ('torch-zip', ['model'], 'module.', {'cpu': 10})
    """
    use_storage_options(storage_options)
    checkpoint = load(path, allow_globals=allow_globals, weights=weights, variant=variant)
    keep(checkpoint)
    return summarize(checkpoint, with_fingerprint=fingerprint, with_tensors=tensors, allow_expansion=allow_expansion)
