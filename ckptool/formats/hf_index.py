"""Finding a Hugging Face safetensors index (``*.safetensors.index.json``) or single file in a folder."""

from __future__ import annotations

from pathlib import Path

from ckptool.base.errors import InputError

INDEX_NAME = "model.safetensors.index.json"


def find_index(directory: Path) -> Path | None:
    """The sharded index inside ``directory``, or its single safetensors file."""
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        return indexes[0]
    if len(indexes) > 1:
        preferred = directory / INDEX_NAME
        if preferred in indexes:
            return preferred
        raise InputError(f"holds {len(indexes)} safetensors indexes — name the one to read", path=directory)
    singles = sorted(directory.glob("*.safetensors"))
    if len(singles) == 1:
        return singles[0]
    return None
