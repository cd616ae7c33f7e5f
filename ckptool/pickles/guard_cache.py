"""What one pickle's walk found (:class:`PickleStats`), and the cache of pickles an operation has walked.

The cache is an object the operation owns (a scan, a save) and passes to its reads: nothing in
ckptool remembers pickle bytes from one operation to the next.
"""

from __future__ import annotations

from typing import Any


class PickleStats:
    """What :func:`guard` saw in one pickle: its length, opcode counts and the globals it names.

    ``globals`` lists GLOBAL/INST names and STACK_GLOBAL names whose strings are known (resolved
    through the memo as the unpickler would); ``<unresolved STACK_GLOBAL>`` otherwise.
    """

    __slots__ = ("size", "counts", "globals")

    def __init__(self, size: int, counts: list[int], globals_: list[str]) -> None:
        self.size, self.counts, self.globals = size, counts, globals_

    def opcode_names(self) -> dict[str, int]:
        """Opcode counts by pickletools name."""
        import pickletools

        names = {op.code.encode("latin1")[0]: op.name for op in pickletools.opcodes}
        return {names.get(code, f"0x{code:02x}"): count for code, count in enumerate(self.counts) if count}


class GuardCache:
    """The pickles one operation has walked or written, by their exact bytes, so none is walked twice.

    A scan lists a pickle's globals and then loads it; a save re-reads the pickle it just emitted
    (:func:`~ckptool.pickles.emit.dump` writes only what torch's weights_only loader reads, from a
    tree that was itself checked: it needs no walk). The operation makes one, hands it to its reads
    (``GlobalResolver(guard_cache=...)``, :func:`guard_stats`, ``read_pickle``) and its ``dump``,
    and drops it when done: nothing remembers pickle bytes from one operation to the next. Only
    pickles the guard passed are kept, the last few of each kind.
    """

    KEEP = 4
    __slots__ = ("_walked", "_emitted")

    def __init__(self) -> None:
        self._walked: dict[bytes, PickleStats] = {}
        self._emitted: dict[bytes, None] = {}

    def walked(self, data: bytes) -> PickleStats | None:
        """What the guard saw in exactly ``data``, if it passed it before."""
        return self._walked.get(data)

    def add_walked(self, data: bytes, stats: PickleStats) -> None:
        """Remember that the guard passed exactly ``data``."""
        self._keep(self._walked, data, stats)

    def is_emitted(self, data: bytes) -> bool:
        """Whether ``data`` is exactly a pickle this operation's ``dump`` wrote."""
        return data in self._emitted

    def add_emitted(self, data: bytes) -> None:
        """Remember a pickle this operation's ``dump`` wrote."""
        self._keep(self._emitted, data, None)

    def _keep(self, table: dict[bytes, Any], data: bytes, value: Any) -> None:
        if len(table) >= self.KEEP:
            del table[next(iter(table))]
        table[data] = value
