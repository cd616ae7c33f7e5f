"""Where a writer places large copied regions: at their source's offset within a page, so the kernel copies whole pages.

``copy_file_range`` between two files of one file system copies page-cache page by page. A region whose output
offset differs from its source offset modulo the page size spans two output pages for every source page, and costs
each page two partial writes: a 1 GiB copy between misplaced offsets took 0.81-1.20 s here (median 0.93) against
0.62-0.77 s (median 0.69) between matched ones (seven of each, interleaved, this machine's ext4). Writers therefore
put each large region (one the kernel
copies: over :data:`~ckptool.files.copying.SMALL_MEMBER` bytes) where ``output offset % PAGE == source offset % PAGE``:

- a zip member (``.pt``) by the padding of its local header, which torch's writer pads to 64 bytes with anyway
  (:func:`zip_padding`);
- a safetensors file, whose data has no gaps, by the spaces that may follow its header's JSON and by the order of
  its tensors: large ones after the small, each followed by small ones whose bytes bring the next large one to its
  place (:func:`safetensors_order`, :func:`header_padding`).

Only regions whose source lies at a multiple of 64 bytes (every torch archive's storages) are matched, so a matched
region keeps torch's 64-byte alignment. Nothing here changes a byte of a tensor, only where it lies.
"""

from __future__ import annotations

from itertools import accumulate, compress, repeat
from operator import gt, mod

from ckptool.files.copying import SMALL_MEMBER

PAGE = 4096
_STORAGE_ALIGNMENT = 64  # torch's: a source region at such an offset keeps it when matched
_MAX_FILLERS = 32  # small regions put between two large ones at most
_SIZES_TRIED = 32  # the most common sizes (modulo the page) of small regions that fillers are drawn from
_SEARCHES = 4  # searches for fillers per order tried (each up to 4096 sums x _SIZES_TRIED sizes: ~30 ms)


def zip_padding(position: int, residue: int) -> int:
    """The bytes of padding (its 4-byte extra-field header included; 0 for none) that put data, which would start at
    ``position`` without it, at ``residue`` within a page (:data:`PAGE`)."""
    padding = (residue - position) % PAGE
    return padding + PAGE if 0 < padding < 4 else padding


def page_residue(offset: int, size: int) -> int | None:
    """The offset within a page a region should be written at: its source's, for a large region at a multiple of 64
    bytes; None for one not worth placing (small ones are read and written through a buffer)."""
    return offset % PAGE if size > SMALL_MEMBER and offset % _STORAGE_ALIGNMENT == 0 else None


def safetensors_order(offsets: list[int], sizes: list[int], itemsizes: list[int]) -> list[int] | None:
    """The order to write regions in (indices into the columns: ``offsets`` in their sources, ``sizes``, element
    sizes, given in the file's usual order, larger element types first) that places the most bytes of large regions
    at their source's offset within a page (:func:`page_residue`) once :func:`header_padding` has padded the header;
    None where the usual order places as many.

    Tried: the small regions whose sizes are multiples of 8 first (in the usual order), then the large ones, each
    followed by the fewest small ones (larger element types first) whose sizes bring the next to its place when its
    own size does not, then the other small ones; the large ones by their offset within a page (those at one offset
    then follow each other with nothing between, when their sizes are multiples of the page), or in the usual
    order. An order that would not keep every region aligned to its element size (from a data start at a multiple
    of 8) is not taken.
    """
    large = [
        i
        for i in compress(range(len(sizes)), map(gt, sizes, repeat(SMALL_MEMBER)))
        if page_residue(offsets[i], sizes[i]) is not None
    ]
    if not large:
        return None
    large_set = set(large)
    small = [i for i in range(len(sizes)) if i not in large_set]
    best, most = None, _best_shift(0, offsets, sizes)[1]
    for chain in (sorted(large, key=lambda i: offsets[i] % PAGE), large):
        order = _chained(chain, small, offsets, sizes, itemsizes)
        if order is not None:
            placed = _best_shift(0, list(map(offsets.__getitem__, order)), list(map(sizes.__getitem__, order)))[1]
            if placed > most:
                best, most = order, placed
    return best


def _chained(
    large: list[int], small: list[int], offsets: list[int], sizes: list[int], itemsizes: list[int]
) -> list[int] | None:
    """:func:`safetensors_order`'s order for the large regions taken in the order ``large`` gives (``small``: the
    others, in the usual order), or None where a region would lie at other than a multiple of its element size (up
    to 8)."""
    # the small regions whose size moves a position within a page, by that move (each list in the usual order)
    by_residue: dict[int, list[int]] = {}
    for index in small:
        residue = sizes[index] % PAGE
        if residue and sizes[index] <= SMALL_MEMBER:
            by_residue.setdefault(residue, []).append(index)
    for indices in by_residue.values():
        indices.reverse()  # taken from the end: the first in the usual order is taken first
    sums, searches = _fewest(by_residue), 1
    chain = [large[0]]
    taken: set[int] = set()
    position = sizes[large[0]]  # relative to the first large region's place (a multiple of 64)
    for index in large[1:]:
        need = (offsets[index] - offsets[large[0]] - position) % PAGE
        chosen = _fill(need, by_residue, sums) if need and position % 8 == 0 else []
        if chosen is None and searches < _SEARCHES:  # the fewest sizes for this need are used up: search those left
            sums, searches = _fewest(by_residue), searches + 1
            chosen = _fill(need, by_residue, sums)
        chosen = chosen or []
        chosen.sort(key=itemsizes.__getitem__, reverse=True)
        taken.update(chosen)
        chain += chosen
        chain.append(index)
        position += sum(map(sizes.__getitem__, chosen)) + sizes[index]
    left = [i for i in small if i not in taken]
    lead = [i for i in left if sizes[i] % 8 == 0]
    order = lead + chain + [i for i in left if sizes[i] % 8]
    # the data start that places the first large region, were the header's JSON to end at a multiple of the page
    start = (offsets[large[0]] - sum(map(sizes.__getitem__, lead))) % PAGE
    starts = accumulate(map(sizes.__getitem__, order), initial=start)
    if any(map(mod, starts, map(min, map(itemsizes.__getitem__, order), repeat(8)))):
        return None
    return order


def header_padding(header_end: int, offsets: list[int], sizes: list[int]) -> int:
    """The spaces to write after a safetensors header's JSON, which ends at ``header_end`` (a multiple of 8), to
    place the most bytes of the large regions written in this order (``offsets`` in their sources, ``sizes``): a
    multiple of 8, so every region keeps its alignment."""
    return _best_shift(header_end, offsets, sizes)[0]


def _best_shift(header_end: int, offsets: list[int], sizes: list[int]) -> tuple[int, int]:
    """:func:`header_padding`, and how many bytes of large regions it places."""
    large = list(compress(range(len(sizes)), map(gt, sizes, repeat(SMALL_MEMBER))))
    if not large:
        return 0, 0
    starts = list(accumulate(sizes, initial=header_end))
    placed: dict[int, int] = {}
    for at in large:
        if page_residue(offsets[at], sizes[at]) is not None:
            shift = (offsets[at] - starts[at]) % PAGE
            if shift % 8 == 0:
                placed[shift] = placed.get(shift, 0) + sizes[at]
    return max(placed.items(), key=lambda item: item[1]) if placed else (0, 0)


def _fill(need: int, by_residue: dict[int, list[int]], sums: dict[int, tuple[int, ...]]) -> list[int] | None:
    """The small regions whose sizes sum to ``need`` modulo the page that ``sums`` (:func:`_fewest`) names, taken out
    of ``by_residue``: [] where none do, None where those named are no longer all left."""
    fewest = sums.get(need)
    if fewest is None:
        return []
    wanted: dict[int, int] = {}
    for residue in fewest:
        wanted[residue] = wanted.get(residue, 0) + 1
    if any(len(by_residue[residue]) < count for residue, count in wanted.items()):
        return None
    return [by_residue[residue].pop() for residue in fewest]


def _fewest(by_residue: dict[int, list[int]]) -> dict[int, tuple[int, ...]]:
    """For each sum modulo the page that the small regions left reach, the fewest of their sizes (of the
    :data:`_SIZES_TRIED` most common) that reach it, each size used no more often than it is left and
    :data:`_MAX_FILLERS` sizes at most; by breadth-first search."""
    sizes = sorted(
        (residue for residue, left in by_residue.items() if left), key=lambda residue: -len(by_residue[residue])
    )[:_SIZES_TRIED]
    fewest: dict[int, tuple[int, ...]] = {0: ()}
    frontier = [0]
    for _ in range(_MAX_FILLERS):
        reached = []
        for total in frontier:
            path = fewest[total]
            for size in sizes:
                new = (total + size) % PAGE
                if new not in fewest and path.count(size) < len(by_residue[size]):
                    fewest[new] = (*path, size)
                    reached.append(new)
        if not reached:
            break
        frontier = reached
    return fewest
