"""DCP directories (``--save-format dcp``): written by every rank, read back with guards, resharded.

``torch.distributed.checkpoint`` writes ``.metadata`` plus ``__<rank>_0.distcp`` files holding
``{"model", "optim", "extra": {"epoch", "config", "metrics"}}`` as torch's ``get_state_dict`` returns
them (optimizer state keyed by parameter name; FSDP shards stay shards). The ranks write into one
temp directory beside ``--out`` that rank 0 renames into place once every rank has finished, so no
reader sees half a checkpoint.

Reading goes through torch's own reader and planner with two guards their defaults lack:
``.metadata`` is unpickled with an allowlist of DCP's metadata classes, and every non-tensor value
is checked with ``torch.load(weights_only=True)`` (torch's planner loads them with
``weights_only=False``).

Also here: the FSDP state-dict moves that go through ``torch.distributed.checkpoint.state_dict``
(gathering the full state onto rank 0, loading a full optimizer state into shards). The module is
imported only by runs that need it: ``torch.distributed.checkpoint`` adds about a second to the
start of every process.

Example:
    >>> save_dcp({"model": model.state_dict()}, Path("ckpt"), is_main=True, distributed=False)
    >>> sorted(p.name for p in Path("ckpt").iterdir())
    ['.metadata', '__0_0.distcp']
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from ckptool.files.atomic import atomic_directory
from ckptool.base.errors import OutputError
from training import TrainingError, UsageError
from training.checkpoints import (
    DCP_EXTRA_KEY,
    DCP_METADATA,
    DCP_MODEL_KEY,
    DCP_OPTIMIZER_KEY,
    EPOCH_KEY,
    OPTIMIZER_KEY,
    is_dcp_directory,
    optimizer_state_by_index,
    optimizer_state_by_name,
)

# --save-format torch under FSDP: gather every shard into whole CPU tensors on rank 0 (the others get {}).
FULL_STATE_DICT = StateDictOptions(full_state_dict=True, cpu_offload=True)

# What a DCP .metadata pickle may name: DCP's own metadata classes and the torch values they hold.
_DCP_METADATA_GLOBALS = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "TensorStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "BytesStorageMetadata",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # looks a layout up by name; builds nothing
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id as given to dcp.save
        ("pathlib", "WindowsPath"),
    }
)
# dcp.save/load warn when they run without a process group; a single-process run means exactly that.
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


# ---------------------------------------------------------------------------------------------
# state dicts through torch.distributed.checkpoint.state_dict (plain or FSDP-sharded models)


def dcp_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any], *, weights_only: bool) -> dict[str, Any]:
    """This rank's share of a DCP checkpoint: ``{"model", "optim", "extra"}`` (``{"model"}`` if ``weights_only``).

    ``get_state_dict`` names parameters as the model does (no ``module.``) and keys the optimizer state
    by those names, so a DDP save, an FSDP save and a one-process save hold the same keys.
    """
    if weights_only:
        return {DCP_MODEL_KEY: get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {DCP_MODEL_KEY: model_state, DCP_OPTIMIZER_KEY: optimizer_state, DCP_EXTRA_KEY: extra}


def gather_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, weights_only: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gather an FSDP model's shards (and its optimizer's) into whole CPU tensors on rank 0.

    A collective: every rank must call it. Returns ``(model_state, optimizer_state)`` on rank 0, the
    optimizer state numbered like ``optimizer.state_dict()`` (``{}`` if ``weights_only``); ``({}, {})``
    on the other ranks.
    """
    if weights_only:
        return get_model_state_dict(model, options=FULL_STATE_DICT), {}
    model_state, optimizer_state = get_state_dict(model, optimizer, options=FULL_STATE_DICT)
    return model_state, optimizer_state_by_index(optimizer_state) if optimizer_state else {}


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load the unsharded model's ``optimizer.state_dict()`` into the optimizer of its FSDP shards.

    Every rank holds the whole state and keeps its own shard of it.

    Raises:
        KeyError, IndexError, ValueError, RuntimeError: the state belongs to another model.
    """
    names = [name for name, _ in model.named_parameters()]  # fully_shard keeps the parameter names
    by_name = optimizer_state_by_name(state_dict, names)
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------------------------------
# --save-format dcp: writing


def save_dcp(state_dict: dict[str, Any], out: Path, *, is_main: bool, distributed: bool) -> None:
    """``dcp.save`` from every rank into a temp directory beside ``out``; rank 0 renames it into place.

    Every rank of the process group must call this with its own share of ``state_dict``; values that
    are not sharded (plain tensors, ints, dicts) must be equal on every rank, because DCP keeps one copy.
    Rank 0 holds the temp directory through :func:`ckptool.files.atomic.atomic_directory` (every file
    fsync'd, then one rename; an existing ``out`` is moved aside and put back if the rename fails).

    Args:
        state_dict: ``{"model": ..., "optim": ..., "extra": {...}}`` (any DCP-savable mapping).
        out: the checkpoint directory; an existing one is replaced (see :func:`check_dcp_output`).
        is_main: this is rank 0 (creates, renames and, on failure, removes the temp directory).
        distributed: a process group is initialised and every rank takes part.

    Raises:
        TrainingError: the save failed on some rank, or the rename did (nothing is left behind).
    """
    try:
        with contextlib.ExitStack() as folder:
            temp_name: str | None = None
            failure: str | None = None
            if is_main:
                try:
                    temp_name = str(folder.enter_context(atomic_directory(out)))
                except OutputError as e:
                    failure = e.message
            if distributed:
                # the ranks must agree on one directory; a failure on rank 0 must stop them all, not hang them
                temp_name, failure = _from_rank0((temp_name, failure))
            if failure is not None:
                raise TrainingError(f"--out {out}: {failure}")
            assert temp_name is not None
            failure, hint = _save_every_rank(state_dict, Path(temp_name), distributed=distributed)
            if failure is not None:  # raised inside: rank 0's temp directory is removed
                raise TrainingError(f"--out {out}: DCP save failed ({failure}){hint}; nothing was written")
    except OutputError as e:  # rank 0 could not move the checkpoint into place
        raise TrainingError(f"--out {out}: cannot move the checkpoint into place: {e.message}") from e


def _save_every_rank(state_dict: dict[str, Any], temp: Path, *, distributed: bool) -> tuple[str | None, str]:
    """``dcp.save`` into ``temp`` on this rank; the first failure of any rank (None) and a hint, on every rank."""
    failure: str | None = None
    hint = ""
    try:
        with _quiet_single_process():
            dcp.save(state_dict, checkpoint_id=temp, no_dist=not distributed)
    except CheckpointException as e:  # raised on every rank when any rank failed
        rank, cause = _first_failure(e)
        failure = f"rank {rank}: {_one_line(cause)}"
        if rank != 0 and isinstance(cause, FileNotFoundError):
            # rank 0 made the directory; a rank that cannot see it runs on another machine
            hint = " — with several nodes, --out must be on a filesystem every node sees"
    except OSError as e:
        failure = _one_line(e)
    if distributed:
        # also the barrier after which every rank's .distcp file is complete
        failure, hint = next(((f, h) for f, h in _all_gathered((failure, hint)) if f is not None), (None, ""))
    return failure, hint


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object)."""
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _all_gathered(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _first_failure(error: CheckpointException) -> tuple[int, BaseException]:
    """The lowest failing rank and its exception (the exception's own text is a traceback per rank)."""
    if not error.failures:
        return 0, error
    rank = min(error.failures)
    cause, _trace = error.failures[rank]
    return rank, cause


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        yield


# ---------------------------------------------------------------------------------------------
# --save-format dcp: reading


class _AllowlistUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``: DCP's metadata classes, ``torch.Size`` and dtypes, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"names {module}.{name}, which a DCP .metadata never holds")


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``.metadata`` goes through an allowlist unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        # the per-rank name is the one torch's reader uses for saves made without collectives
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
        with open(Path(self.path) / name, "rb") as handle:
            metadata = _AllowlistUnpickler(handle).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP Metadata")
        # what torch's read_metadata adds after unpickling
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """torch's default load planner, but a non-tensor value must load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # raises UnpicklingError on anything weights_only refuses, before the default (unrestricted) load
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def read_dcp_metadata(path: Path) -> Metadata:
    """The ``.metadata`` of the DCP directory ``path``, unpickled through the allowlist.

    Raises:
        UsageError: ``path`` is not a directory with a ``.metadata`` file.
        TrainingError: the metadata cannot be read or names something outside the allowlist.
    """
    if not is_dcp_directory(path):
        raise UsageError(
            f"--resume {path}: not a DCP checkpoint directory (no {DCP_METADATA}) — "
            "give a checkpoint saved by python -m training"
        )
    try:
        return SafeFileSystemReader(path).read_metadata()
    except (pickle.UnpicklingError, OSError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise TrainingError(
            f"--resume {path}: its {DCP_METADATA} cannot be read safely ({_one_line(e)}) — "
            "resume from a checkpoint saved by python -m training"
        ) from e


class _WeightsOnlyEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """torch's planner that rebuilds the whole saved object; a non-tensor value must load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # raises UnpicklingError on anything weights_only refuses
        value.seek(0)
        super().load_bytes(read_item, value)


def load_dcp_container(path: Path) -> dict | None:
    """A DCP directory that holds a ``--save-format torch`` checkpoint's container (``model.*``,
    ``optimizer.*``, ``epoch``: what ``ckptool convert --to dcp`` or torch's ``torch_save_to_dcp``
    write), loaded whole onto the CPU as ``torch.load`` gives the file; None for another layout.

    Raises:
        UsageError: ``path`` is not a DCP directory.
        TrainingError: its metadata or a value cannot be read safely.
    """
    keys = read_dcp_metadata(path).state_dict_metadata
    if EPOCH_KEY not in keys or not any(key.startswith(f"{OPTIMIZER_KEY}.") for key in keys):
        return None
    state: dict[str, Any] = {}
    try:
        with _quiet_single_process():
            _load_state_dict(state, storage_reader=SafeFileSystemReader(path), planner=_WeightsOnlyEmptyLoadPlanner(),
                             no_dist=True)
    except (CheckpointException, pickle.UnpicklingError, OSError, RuntimeError, ValueError) as e:
        raise TrainingError(f"--resume {path}: cannot be loaded safely ({_one_line(e)}) — "
                            "resume from a checkpoint saved by python -m training") from e
    optimizer = state.get(OPTIMIZER_KEY)
    if isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict):
        # DCP keys are strings; optimizer.load_state_dict matches the state to parameters by int id
        optimizer["state"] = {int(key) if isinstance(key, str) and key.isdigit() else key: value
                              for key, value in optimizer["state"].items()}
    return state


def check_dcp_training_checkpoint(path: Path, model_state: Mapping[str, Any], *, model_name: str) -> Metadata:
    """Read the metadata of a DCP directory; check it is a full training checkpoint that fits the model.

    Args:
        path: the DCP directory.
        model_state: the model's state dict (or ``get_state_dict``'s) — only names and shapes are used.
        model_name: the ``--model`` given, for the error message.

    Raises:
        UsageError: ``path`` is not a DCP directory.
        TrainingError: its metadata is unreadable; it lacks the optimizer state or the epoch; or its
            model entries differ from the model's in name or shape.
    """
    metadata = read_dcp_metadata(path)
    keys = metadata.state_dict_metadata
    has_optimizer = any(key.startswith(f"{DCP_OPTIMIZER_KEY}.") for key in keys)
    epoch_key = f"{DCP_EXTRA_KEY}.{EPOCH_KEY}"
    if not has_optimizer or epoch_key not in keys:
        raise TrainingError(
            f"--resume {path}: not a full DCP training checkpoint (needs {DCP_OPTIMIZER_KEY}.* and {epoch_key}; "
            "a --weights-only save has no optimizer state) — resume from a save without --weights-only"
        )
    mismatch = _first_model_mismatch(model_state, metadata)
    if mismatch is not None:
        raise TrainingError(
            f"--resume {path}: does not fit --model {model_name} ({mismatch}) — pass the --model the checkpoint was trained with"
        )
    return metadata


def load_dcp(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, model_name: str, distributed: bool) -> int:
    """Load a DCP training checkpoint into ``model`` and ``optimizer`` in place; return its epoch.

    Every rank of the process group must call this. DCP reshards on the way in: a checkpoint saved by
    N DDP or FSDP ranks loads into M ranks of either, or into one process.

    Args:
        path: the DCP directory.
        model: the model as trained (plain, or sharded by ``fully_shard``); not a DP/DDP wrapper.
        optimizer: its optimizer, over its current parameters.
        model_name: the ``--model`` given, for the error message.
        distributed: a process group is initialised and every rank takes part.

    Raises:
        UsageError: ``path`` is not a DCP directory.
        TrainingError: it is not a full training checkpoint, does not fit the model, or cannot be read.
    """
    model_state, optimizer_state = get_state_dict(model, optimizer)
    check_dcp_training_checkpoint(path, model_state, model_name=model_name)
    state_dict = {
        DCP_MODEL_KEY: model_state,
        DCP_OPTIMIZER_KEY: optimizer_state,
        DCP_EXTRA_KEY: {EPOCH_KEY: -1},  # a placeholder of the right kind, filled in by dcp.load
    }
    try:
        with _quiet_single_process():
            dcp.load(
                state_dict,
                storage_reader=SafeFileSystemReader(path),
                planner=WeightsOnlyLoadPlanner(),
                no_dist=not distributed,
            )
    except CheckpointException as e:
        rank, cause = _first_failure(e)
        raise TrainingError(
            f"--resume {path}: cannot be loaded (rank {rank}: {_one_line(cause)}) — resume from a checkpoint saved by python -m training"
        ) from e
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state_dict[DCP_MODEL_KEY],
        optim_state_dict=state_dict[DCP_OPTIMIZER_KEY],
    )
    epoch = state_dict[DCP_EXTRA_KEY][EPOCH_KEY]
    if type(epoch) is not int or epoch < 0:
        raise TrainingError(f"--resume {path}: {DCP_EXTRA_KEY}.{EPOCH_KEY} is {epoch!r}, not a count of epochs — the checkpoint is corrupt")
    return epoch


def _first_model_mismatch(model_state: Mapping[str, Any], metadata: Metadata) -> str | None:
    """The first model entry the checkpoint lacks or holds at another shape, in torch's words."""
    saved = metadata.state_dict_metadata
    expected = {f"{DCP_MODEL_KEY}.{name}" for name in model_state}
    for name, tensor in model_state.items():
        key = f"{DCP_MODEL_KEY}.{name}"
        entry = saved.get(key)
        if entry is None:
            return f"Missing key(s) in state_dict: {name!r}"
        size = getattr(entry, "size", None)
        if size is not None and tuple(size) != tuple(tensor.shape):
            return f"size mismatch for {name}: copying a param with shape {tuple(size)}, the model has {tuple(tensor.shape)}"
    unexpected = sorted(key for key in saved if key.startswith(f"{DCP_MODEL_KEY}.") and key not in expected)
    if unexpected:
        return f"Unexpected key(s) in state_dict: {unexpected[0].removeprefix(DCP_MODEL_KEY + '.')!r}"
    return None
