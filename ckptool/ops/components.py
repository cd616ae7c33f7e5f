"""A model folder's components as inspect reports them: each one's file, format, variants and counts.

Each component is read as ``--weights <name>`` reads it (restricted, lazy: no tensor byte is read);
one that cannot be read is listed with the reason, and the others still are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptool.base.errors import CkptError
from ckptool.formats.model_folder import Component, FolderLayout
from ckptool.tensors.refs import census


@dataclass
class ComponentState:
    """One component of a model folder (``--json``: ``training_folder.components``).

    Attributes:
        name: what ``--weights`` takes (``unet``; the top's stem, ``model``).
        file: the weights file read, from the top of the folder (an index for a sharded set).
        format: the format of that file (``safetensors``, ``torch-zip``...).
        variant: the variant read (None: the default weights).
        variants: every variant the component holds (``fp16``...).
        tensors, parameters, bytes, dtypes: what its weights hold (None when unread).
        chosen: the weights the rest of inspect describes are this component's (or all, for a
            folder read as all of its components).
        problem: why it could not be read.
    """

    name: str
    file: str
    format: str | None = None
    variant: str | None = None
    variants: list[str] = field(default_factory=list)
    tensors: int | None = None
    parameters: int | None = None
    bytes: int | None = None
    dtypes: dict[str, int] = field(default_factory=dict)
    chosen: bool = False
    problem: str | None = None


def describe_components(layout: FolderLayout, allow_globals: tuple[str, ...] = ()) -> list[ComponentState]:
    """Every component of ``layout``, read one by one (a problem is reported, not raised)."""
    from ckptool.io.reader import load_member

    states: list[ComponentState] = []
    for part in layout.components:
        name, variant = part.file_for(layout.variant)
        state = ComponentState(
            part.name,
            part.path(layout.variant) or part.directory,
            variant=variant,
            variants=part.variants,
            chosen=layout.read is None or _is(layout.read, part),
        )
        try:
            member = load_member(layout.directory, _member_name(part, layout), allow_globals=allow_globals,
                                 variant=layout.variant)  # fmt: skip
            tensors = member.tensors if member.has_weights else {}
            counted = census(list(tensors.values()))
            state.format = member.format
            state.tensors, state.parameters, state.bytes = len(tensors), counted.parameters, counted.nbytes
            state.dtypes = dict(sorted(counted.dtypes.items()))
        except CkptError as e:
            state.problem = e.message
        states.append(state)
    return states


def _member_name(part: Component, layout: FolderLayout) -> str:
    return part.directory or part.path(layout.variant)


def _is(read: str, part: Component) -> bool:
    return read in (part.name, part.directory) or (not part.directory and read.split(".")[0] == part.name)


def to_json(states: list[ComponentState]) -> list[dict[str, Any]]:
    from dataclasses import asdict

    return [asdict(state) for state in states]
