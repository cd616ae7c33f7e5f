"""What a training folder holds besides its weights, as plain data for ``inspect``.

Each file of a :class:`~ckptool.formats.training_folder.TrainingFolder` is read as what it is —
an optimizer's state dict, a learning-rate scheduler's, the random number generators' states,
``trainer_state.json``, a pickled ``TrainingArguments`` — through the same restricted reader as
any checkpoint (nothing it names runs, no tensor bytes are read), and described in a line plus
the facts a script wants (``--json``). A file that cannot be read with the globals allowed (a
pickled ``TrainingArguments`` is a transformers class: it needs trust), or that is damaged, is
described as such; it never makes the folder unreadable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptool.base.errors import CkptError, InputError, UnsafeCheckpointError
from ckptool.files import inputs
from ckptool.files.byteio import read_capped
from ckptool.formats import model_folder, training_folder
from ckptool.formats.training_folder import FolderFile, TrainingFolder
from ckptool.model import optimizers
from ckptool.model.tree import iter_tensors
from ckptool.pickles import OpaqueObject, runs_code
from ckptool.tensors.refs import TensorRef

MAX_JSON_BYTES = 64 << 20  # trainer_state.json grows with its log history; a long run's is a few MB
_ARGS_SHOWN = (
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "lr_scheduler_type",
    "optim",
    "seed",
)


@dataclass
class FileState:
    """One file of the folder: its role, a line saying what it holds, and the facts behind it.

    ``needs``: the globals outside the allowlist that reading it takes (trust), when it was
    refused for them; ``problem``: why it could not be read otherwise.
    """

    file: str
    role: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    needs: list[str] = field(default_factory=list)
    dangerous: list[str] = field(default_factory=list)
    problem: str | None = None


@dataclass
class FolderState:
    """A training folder as inspect reports it (``--json``: ``training_folder``)."""

    kind: str
    weights_files: list[str]
    files: list[FileState]
    step: int | None = None
    step_from: str | None = None
    # a model folder's components, each as --weights NAME reads it (ops.components.ComponentState)
    components: list[Any] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)


def _human_bytes(size: int) -> str:
    from ckptool.model.describe import human_bytes as human

    return human(size)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _scalar(value: Any) -> bool:
    return isinstance(value, bool | int | float | str) or value is None


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and all(isinstance(item, float) for item in value):
        shown = ", ".join(f"{item:.4g}" for item in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"[{shown}]"
    if isinstance(value, OpaqueObject) and value._args and _scalar(value._args[0]):  # an enum member
        return str(value._args[0])
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def describe_optimizer(container: Any) -> tuple[str, dict[str, Any]]:
    """An optimizer's state (:func:`~ckptool.model.optimizers.is_optimizer_state` said it is one):
    a line, and the details."""
    state = optimizers.per_parameter_state(container)
    groups = optimizers.param_groups(container)
    tensors = [tensor for _, tensor in iter_tensors(container)]
    details: dict[str, Any] = {
        "optimizer": optimizers.optimizer_kind(container),
        "params": len(state),
        "param_groups": len(groups),
        "tensors": len(tensors),
        "bytes": sum(t.nbytes for t in tensors),
        "per_parameter": optimizers.state_names(container),
    }
    lrs = [group.get("lr") for group in groups if isinstance(group, dict)]
    if lrs and all(isinstance(lr, float | int) and not isinstance(lr, bool) for lr in lrs):
        details["lr"] = lrs
    from ckptool.model.describe import describe_optimizer_state

    return describe_optimizer_state(container), details


def describe_scheduler(container: Any) -> tuple[str, dict[str, Any]]:
    keep = ("last_epoch", "_step_count", "base_lrs", "_last_lr")
    details = {
        key.lstrip("_"): dict.get(container, key)
        for key in keep
        if isinstance(container, dict)
        and key in container
        and (_scalar(dict.get(container, key)) or isinstance(dict.get(container, key), list))
    }
    parts = []
    if isinstance(details.get("last_epoch"), int):
        parts.append(f"last_epoch {details['last_epoch']}")
    if isinstance(details.get("last_lr"), list):
        parts.append(f"lr {_short(details['last_lr'])}")
    if isinstance(details.get("base_lrs"), list):
        parts.append(f"base {_short(details['base_lrs'])}")
    if not parts:
        return _generic(container), details
    return "learning-rate schedule: " + ", ".join(parts), details


def describe_rng(container: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(container, dict):
        return _generic(container), {}
    names = [str(key) for key in container if key != "step"]
    details: dict[str, Any] = {"generators": names}
    step = dict.get(container, "step")
    if isinstance(step, int) and not isinstance(step, bool):
        details["step"] = step
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "") or "none"
    return f"random number generator states: {shown}" + (f" (step {step})" if "step" in details else ""), details


def describe_scaler(container: Any) -> tuple[str, dict[str, Any]]:
    scale = dict.get(container, "scale") if isinstance(container, dict) else None
    if isinstance(scale, float | int):
        return f"gradient scaler state: scale {scale:g}", {"scale": scale}
    return _generic(container), {}


def describe_args(container: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(container, OpaqueObject) or not isinstance(container.state, dict):
        return _generic(container), {}
    fields = container.state
    values = {name: fields[name] for name in _ARGS_SHOWN if name in fields}
    details = {
        "class": container.global_name,
        "values": {name: _short(value) if not _scalar(value) else value for name, value in values.items()},
    }
    shown = ", ".join(f"{name} {_short(value)}" for name, value in values.items())
    return f"{container.global_name}" + (f": {shown}" if shown else ""), details


def _generic(container: Any) -> str:
    from ckptool.model.describe import describe_entry

    return describe_entry(container)


_DESCRIBE = {
    training_folder.OPTIMIZER: describe_optimizer,
    training_folder.SCHEDULER: describe_scheduler,
    training_folder.RNG_STATE: describe_rng,
    training_folder.SCALER: describe_scaler,
    training_folder.TRAINING_ARGS: describe_args,
}


def _read_json(folder: Path, name: str) -> Any:
    with inputs.open_member(folder, folder / name, what=name, report=folder) as handle:
        raw = read_capped(handle, MAX_JSON_BYTES)
    if raw is None:
        raise InputError(f"{name} is over {MAX_JSON_BYTES >> 20} MB — not read", path=folder)
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise InputError(f"{name} is not valid UTF-8 JSON", path=folder) from e


def describe_trainer_state(value: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(value, dict):
        return "not a trainer state (JSON, but not an object)", {}
    keep = ("global_step", "max_steps", "epoch", "num_train_epochs", "best_metric", "best_model_checkpoint")
    details = {key: value[key] for key in keep if key in value and _scalar(value[key])}
    history = value.get("log_history")
    if isinstance(history, list):
        details["log_entries"] = len(history)
    parts = []
    if _integer(details.get("global_step")):
        max_steps = details.get("max_steps")
        parts.append(f"global_step {details['global_step']}" + (f" of {max_steps}" if _integer(max_steps) else ""))
    if isinstance(details.get("epoch"), float | int):
        parts.append(f"epoch {_short(details['epoch'])}")
    if "log_entries" in details:
        parts.append(f"{details['log_entries']} log entr{'y' if details['log_entries'] == 1 else 'ies'}")
    if details.get("best_metric") is not None:
        parts.append(f"best metric {_short(details['best_metric'])}")
    return "trainer state: " + (", ".join(parts) or "no step recorded"), details


def describe_config(value: Any) -> tuple[str, dict[str, Any]]:
    if not isinstance(value, dict):
        return "JSON, but not an object", {}
    details = {key: value[key] for key in ("model_type", "architectures", "torch_dtype", "dtype") if key in value}
    shown = ", ".join(f"{key} {_short(item)}" for key, item in details.items())
    return "model config" + (f": {shown}" if shown else ""), details


def describe_file(folder: Path, file: FolderFile, allow_globals: tuple[str, ...]) -> FileState:
    """One file of the folder, read as what its role says it is (never raises for the file's content)."""
    from ckptool.io.reader import load_member

    if file.role == model_folder.CONFIG:  # a model folder's configs, tokenizer, scheduler, model card
        return describe_other(folder, file)
    try:
        if file.name.endswith(".json"):
            value = _read_json(folder, file.name)
            summary, details = (
                describe_trainer_state if file.role == training_folder.TRAINER_STATE else describe_config
            )(value)
            return FileState(file.name, file.role, summary, details)
        checkpoint = load_member(folder, file.name, allow_globals=allow_globals)
    except UnsafeCheckpointError as e:
        names = list(e.globals or [])
        dangerous = [name for name in names if runs_code(name)]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        if dangerous:
            summary = (
                f"refused: its pickle names code-running globals ({', '.join(dangerous[:4])}) — do not torch.load it"
            )
        else:
            summary = f"pickles {shown}: a package's own classes, read only when allowed (they need trust)"
        return FileState(file.name, file.role, summary, needs=names, dangerous=dangerous)
    except CkptError as e:
        return FileState(file.name, file.role, f"unreadable: {e.message}", problem=e.message)
    container = checkpoint.container
    if file.role == training_folder.OPTIMIZER and not optimizers.is_optimizer_state(container):
        summary, details = _generic(container), {}
    else:
        describe = _DESCRIBE.get(file.role)
        if describe is not None:
            summary, details = describe(container)
        elif optimizers.is_optimizer_state(container):
            summary, details = describe_optimizer(container)
        else:
            summary, details = _generic(container), {}
    tensors = [tensor for _, tensor in iter_tensors(container) if isinstance(tensor, TensorRef)]
    if tensors and "tensors" not in details:
        details["tensors"] = len(tensors)
    return FileState(file.name, file.role, summary, details)


def describe_other(folder: Path, file: FolderFile) -> FileState:
    """A file of a model folder beside the weights, by what its content says it is."""
    from ckptool.ops.folder_configs import describe_config

    info = describe_config(folder / file.name, folder=folder)
    if info is None:
        return FileState(file.name, "file", "not described")
    return FileState(file.name, info.kind, info.summary, dict(info.details), problem=info.problem)


def describe_folder(folder: TrainingFolder, allow_globals: tuple[str, ...] = ()) -> FolderState:
    """Every file of a training folder beside its weights, and the step the run had reached
    (``global_step`` of ``trainer_state.json``, else the step accelerate records with its rng state)."""
    described = [describe_file(folder.directory, file, allow_globals) for file in folder.files]
    state = FolderState(folder.kind, [file.name for file in folder.weights], described, variants=folder.variants)
    if folder.components:
        from ckptool.ops.components import describe_components

        state.components = describe_components(folder, allow_globals)
    for file in described:
        step = file.details.get("global_step" if file.role == training_folder.TRAINER_STATE else "step")
        if (
            file.role in (training_folder.TRAINER_STATE, training_folder.RNG_STATE)
            and isinstance(step, int)
            and not isinstance(step, bool)
        ):
            if state.step is None or file.role == training_folder.TRAINER_STATE:
                state.step, state.step_from = step, file.file
            if file.role == training_folder.TRAINER_STATE:
                break
    return state


_RNG_NAMES = frozenset(
    {
        "python",
        "numpy",
        "cpu",
        "cuda",
        "mps",
        "xpu",
        "npu",
        "hpu",
        "mlu",
        "musa",
        "random_state",
        "numpy_random_seed",
        "torch_manual_seed",
        "torch_cuda_manual_seed",
        "torch_xpu_manual_seed",
        "xm_seed",
        "step",
    }
)


def describe_content(container: Any) -> str | None:
    """What a file without model weights holds when it is a training run's part (an optimizer's,
    a scheduler's, a gradient scaler's state, the random number generators'), or None."""
    if optimizers.is_optimizer_state(container):
        return describe_optimizer(container)[0]
    if not isinstance(container, dict) or not container or not all(isinstance(key, str) for key in container):
        return None
    keys = set(container)
    if "last_epoch" in keys and ("base_lrs" in keys or "_last_lr" in keys):
        return describe_scheduler(container)[0]
    if {"scale", "growth_factor"} <= keys:
        return describe_scaler(container)[0]
    if keys <= _RNG_NAMES and keys - {"step"}:
        return describe_rng(container)[0]
    return None
