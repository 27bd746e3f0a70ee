"""`BatchLayout`: which rows of a packed batch belong to which adapter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass
class BatchLayout:
    """Adapter ``names[i]`` owns rows ``[starts[i], ends[i])`` of the packed batch.

    Treated as immutable (not frozen only so that Lightning can move batches that carry it).

    Segments are sorted, disjoint and may leave rows without an adapter (those rows get the frozen
    base output only). A segment may be empty (an adapter with no rows this step).
    """

    names: tuple[str, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    num_rows: int

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.starts) == len(self.ends)):
            raise ValueError("BatchLayout: `names`, `starts` and `ends` must have the same length")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"BatchLayout: duplicate adapter names in {self.names}")
        prev = 0
        for name, start, end in zip(self.names, self.starts, self.ends):
            if not (prev <= start <= end <= self.num_rows):
                raise ValueError(
                    f"BatchLayout: segment of {name!r} [{start}, {end}) must be sorted, disjoint and "
                    f"within [0, {self.num_rows}]"
                )
            prev = end

    @classmethod
    def from_sizes(cls, names: Sequence[str], sizes: Sequence[int]) -> "BatchLayout":
        """Consecutive segments: adapter ``names[i]`` gets the next ``sizes[i]`` rows."""
        starts, ends, offset = [], [], 0
        for size in sizes:
            if size < 0:
                raise ValueError(f"BatchLayout.from_sizes: sizes must be >= 0, got {list(sizes)}")
            starts.append(offset)
            offset += size
            ends.append(offset)
        return cls(tuple(names), tuple(starts), tuple(ends), offset)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in zip(self.starts, self.ends))
