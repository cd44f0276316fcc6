"""The data iterators of a rank's chunks: chunks given the same iterator each see every
micro-batch once (the first to ask reads it, the others replay it)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence


class _SharedBatches:
    """Chunks given the same iterator each see every micro-batch once: the first to ask reads
    it, the others replay it."""

    def __init__(self, source: Iterator, readers: int):
        self.source, self.readers = source, readers
        self.cache: dict[int, list] = {}  # index -> [item, readers left]
        self.read = 0

    def view(self) -> Iterator:
        index = 0
        while True:
            if index == self.read:
                self.cache[index] = [next(self.source), self.readers]
                self.read += 1
            entry = self.cache[index]
            entry[1] -= 1
            if entry[1] == 0:
                del self.cache[index]
            yield entry[0]
            index += 1


def per_chunk_iterators(data_iterator: Sequence[Iterator | None]) -> list[Iterator | None]:
    groups: dict[int, list[int]] = {}
    for c, it in enumerate(data_iterator):
        if it is not None:
            groups.setdefault(id(it), []).append(c)
    out = list(data_iterator)
    for chunks in groups.values():
        if len(chunks) > 1:
            shared = _SharedBatches(data_iterator[chunks[0]], len(chunks))
            for c in chunks:
                out[c] = shared.view()
    return out
