"""Writing a checkpoint as a ``torch.distributed.checkpoint`` (DCP) folder: ``convert --to dcp``.

The whole container is written, as torch's ``format_utils.torch_save_to_dcp`` writes what
``torch.load`` gives: the weights and the other entries (optimizer state, epoch, config), nested
keys kept, so ``dcp.load`` (or ``dcp_to_torch_save``) gives the same object back. The write goes
through torch's own ``dcp.save`` (one process, no process group) into a temp folder beside the
output; that folder is read back through ckptool's DCP reader and every tensor's values compared
with the source's by fingerprint before it takes the output's place. What a DCP folder cannot hold
without running code on load (objects of other globals) is left out and named in the notes.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckptool.base.errors import FingerprintMismatchError, OutputError
from ckptool.files.atomic import atomic_directory, check_output
from ckptool.io.writer import SaveReport
from ckptool.model.checkpoint import Checkpoint
from ckptool.pickles import OpaqueObject
from ckptool.tensors.digest import fingerprint as weights_fingerprint
from ckptool.tensors.refs import DeviceRef, SizeRef, TensorRef, check_expansion

_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _container(checkpoint: Checkpoint) -> Any:
    """What is written: the container, or a whole-model pickle's weights as a plain state dict."""
    if checkpoint.whole_model:
        return checkpoint.state_dict
    return checkpoint.container


def _as_torch(value: Any, path: tuple[Any, ...], left: list[str]) -> Any:
    """``value`` with lazy tensors made torch tensors (memory-mapped), torch's records made torch's
    objects; an object of another global is left out (its key path added to ``left``)."""
    from ckptool.ops.load_into import to_state_dict

    if isinstance(value, TensorRef):
        return to_state_dict({"t": value})["t"]
    if isinstance(value, SizeRef):
        import torch

        return torch.Size(value)
    if isinstance(value, DeviceRef):
        import torch

        return torch.device(str(value))
    if isinstance(value, OpaqueObject) or not isinstance(value, (*_PLAIN, dict, list, tuple)):
        left.append("/".join(str(key) for key in path) or "(top level)")
        return _LEFT_OUT
    if isinstance(value, dict):
        items = ((key, _as_torch(item, (*path, key), left)) for key, item in dict.items(value))
        return {key: item for key, item in items if item is not _LEFT_OUT}
    if isinstance(value, list | tuple):
        converted = [_as_torch(item, (*path, index), left) for index, item in enumerate(value)]
        kept = [item for item in converted if item is not _LEFT_OUT]
        return kept if isinstance(value, list) else tuple(kept)
    return value


_LEFT_OUT = object()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """dcp.save warns that it runs without a process group: one process is what this is."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def save_dcp(
    checkpoint: Checkpoint,
    out: Path,
    *,
    force: bool = False,
    fingerprint: bool = False,
    allow_expansion: bool = False,
    dry_run: bool = False,
) -> SaveReport:
    """Write ``checkpoint`` as a DCP folder at ``out`` (atomically: a temp folder renamed into place),
    and prove every tensor reads back with the same values.

    Raises:
        OutputError: ``out`` exists without ``force``, or holds the input.
        FingerprintMismatchError: the folder did not read back with the source's values (it is removed).
    """
    out = Path(out)
    inputs = tuple(checkpoint.files) + (checkpoint.path,)
    check_output(out, inputs=inputs, force=force)
    tensors = checkpoint.tensors if checkpoint.has_weights else {}
    check_expansion(tensors, allow=allow_expansion, path=checkpoint.path, doing="write")
    notes: list[str] = []
    if checkpoint.whole_model:
        notes.append(f"whole-model pickle ({checkpoint.module_class}): wrote its weights as a plain state dict")
    if dry_run:
        return SaveReport(
            path=out,
            format="dcp",
            files=[out / ".metadata", out / "__0_0.distcp"],
            tensors=len(tensors),
            bytes=sum(t.nbytes for t in tensors.values()),
            dry_run=True,
            notes=notes,
        )
    from ckptool.base.torch_import import import_torch

    import_torch("writing a DCP folder")
    import torch.distributed.checkpoint as dcp

    left: list[str] = []
    state = _as_torch(_container(checkpoint), (), left)
    if not isinstance(state, dict):
        raise OutputError(
            "a DCP folder holds a mapping of names to values; this checkpoint's top level is a "
            f"{type(_container(checkpoint)).__name__} — write .pt or safetensors instead",
            path=out,
        )
    if left:
        shown = ", ".join(left[:5]) + (", ..." if len(left) > 5 else "")
        notes.append(
            f"left out {len(left)} object(s) of pickle globals a DCP folder cannot hold without running code: {shown}"
        )
    expected = weights_fingerprint(tensors, allow_expansion=True)
    with atomic_directory(out) as folder:
        with _quiet():
            dcp.save(state, checkpoint_id=folder, no_dist=True)
        del state
        from ckptool.io.reader import load

        written = load(folder)
        if checkpoint.layout is not None and not checkpoint.whole_model and written.layout != checkpoint.layout:
            written = written.select_weights(checkpoint.layout)
        got = written.tensors if written.has_weights else {}
        if sorted(got) != sorted(tensors) or weights_fingerprint(got, allow_expansion=True) != expected:
            raise FingerprintMismatchError(
                "the DCP folder did not read back with the weights' values — nothing was written; report it", path=out
            )
    files = sorted(path for path in out.iterdir() if path.is_file())
    return SaveReport(
        path=out,
        format="dcp",
        files=files,
        tensors=len(tensors),
        bytes=sum(t.nbytes for t in tensors.values()),
        checked=len(tensors),
        fingerprint=expected if fingerprint else None,
        notes=notes,
    )
