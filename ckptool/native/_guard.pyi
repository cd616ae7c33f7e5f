"""The opcode guard's walk in C (``_guard.c``); ``opcode_guard`` calls it, and falls back to its Python walk."""

from collections.abc import Container

def walk(
    data: bytes,
    max_unpickled_bytes: int,
    max_pickle_bytes: int,
    max_key_nodes: int,
    max_hash_collisions: int,
    max_nesting: int,
    max_globals: int,
    torch_globals: Container[str],
    /,
) -> tuple[int, list[int], list[str]] | str | None:
    """(size, counts, globals) for a pickle that passes; None when ``data`` ends before STOP; a refusal's message."""
