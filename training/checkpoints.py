"""The two save formats of a run, and what needs no ``torch.distributed.checkpoint``.

* ``torch`` — one file, ``{"model", "optimizer", "epoch", "config", "metrics"}`` saved by rank 0 through
  a temp file beside ``--out`` (fsync, rename). Its optimizer state is ``optimizer.state_dict()``'s in
  every mode, FSDP included: parameters numbered 0, 1, ... in the model's parameter order.
* ``dcp`` — a ``torch.distributed.checkpoint`` directory written by every rank (see
  :mod:`training.dcp_io`): ``.metadata`` plus ``__<rank>_0.distcp`` files holding
  ``{"model", "optim", "extra": {"epoch", "config", "metrics"}}``.

Example:
    >>> save_torch({"model": model.state_dict()}, Path("model.pt"))
    >>> optimizer_state_by_index({"state": {"fc.weight": {}}, "param_groups": [{"params": ["fc.weight"]}]})
    {'state': {0: {}}, 'param_groups': [{'params': [0]}]}
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckptool.files.atomic import atomic_output
from ckptool.base.errors import OutputError
from training import TrainingError
from training.options import DCP_METADATA, SAVE_FORMATS, check_dcp_output, is_dcp_directory  # noqa: F401  (re-exported)

# Keys of the full training checkpoint (--save-format torch); "model" holds the weights.
MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
EPOCH_KEY = "epoch"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
# Top-level keys of a DCP training checkpoint, the names torch's DCP examples and torchtitan use;
# epoch, config and metrics sit under "extra" as plain values (DCP pickles them into the .distcp files).
DCP_MODEL_KEY = "model"
DCP_OPTIMIZER_KEY = "optim"
DCP_EXTRA_KEY = "extra"


# ---------------------------------------------------------------------------------------------
# --save-format torch


def save_torch(obj: object, out: Path) -> None:
    """``torch.save`` to a temp file beside ``out``, fsync, rename into place.

    Raises:
        TrainingError: the file could not be written (nothing is left behind).
    """
    try:
        with atomic_output(out) as (handle, _temp_path):
            torch.save(obj, handle)
    except OutputError as e:
        raise TrainingError(f"--out {out}: {e.message}") from e


def optimizer_state_by_index(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Renumber a name-keyed optimizer state (``get_state_dict``'s) the way ``optimizer.state_dict()`` does.

    Parameters are numbered 0, 1, ... in the order the param groups list them, which is the order a
    plain ``Adam(model.parameters())`` numbers them in, so the result loads into an unsharded model's
    optimizer with ``optimizer.load_state_dict``.

    Example:
        >>> optimizer_state_by_index({"state": {"fc.weight": {}}, "param_groups": [{"params": ["fc.weight"]}]})
        {'state': {0: {}}, 'param_groups': [{'params': [0]}]}
    """
    index: dict[str, int] = {}
    groups = []
    for group in state_dict["param_groups"]:
        numbers = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": numbers})
    state = {index[name]: value for name, value in state_dict["state"].items()}
    return {"state": state, "param_groups": groups}


def optimizer_state_by_name(state_dict: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_index`: number ``i`` becomes ``names[i]``.

    Raises:
        KeyError: the state numbers a parameter beyond ``names`` (it belongs to another model).
    """
    groups = [{**group, "params": [names[number] for number in group["params"]]} for group in state_dict["param_groups"]]
    state = {names[number]: value for number, value in state_dict["state"].items()}
    return {"state": state, "param_groups": groups}
