"""`BatchLayout`: which rows of a packed batch belong to which adapter."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Collection, Optional, Sequence

PADDING_SIDES = (None, "right", "left")


@dataclass
class BatchLayout:
    """Adapter ``names[i]`` owns rows ``[starts[i], ends[i])`` of the packed batch.

    Treated as immutable (not frozen only so that Lightning can move batches that carry it).

    Segments are sorted, disjoint and may leave rows without an adapter (those rows get the frozen
    base output only). A segment may be empty (an adapter with no rows this step).

    ``padding_side``: where the batch's rows are padded, when known (not part of equality). ``"right"`` (as
    `MultiLoRADataModule` packs): every row's tokens come first, so a causal model needs no attention mask
    for them, which lets ``MultiLoRAModule(cuda_graphs=True)`` capture the step.
    """

    names: tuple[str, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    num_rows: int
    padding_side: Optional[str] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.names, str) or not all(isinstance(n, str) for n in self.names):
            raise ValueError(f"BatchLayout: `names` must be a sequence of adapter names (strings), got {self.names!r}")
        for what in ("starts", "ends"):
            values = getattr(self, what)
            if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
                raise ValueError(f"BatchLayout: `{what}` must be a sequence of row indices (integers), got {values!r}")
        if isinstance(self.num_rows, bool) or not isinstance(self.num_rows, numbers.Integral) or self.num_rows < 0:
            raise ValueError(f"BatchLayout: `num_rows` must be an integer >= 0, got {self.num_rows!r}")
        # tuples of Python ints, whatever sequences were given (the layers key their caches on them)
        self.names, self.starts, self.ends = tuple(self.names), tuple(map(int, self.starts)), tuple(map(int, self.ends))
        self.num_rows = int(self.num_rows)
        if self.padding_side not in PADDING_SIDES:
            raise ValueError(f"BatchLayout: `padding_side` can be None, 'right' or 'left', got {self.padding_side!r}")
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
    def from_sizes(cls, names: Sequence[str], sizes: Sequence[int], padding_side: Optional[str] = None,
                   num_rows: Optional[int] = None) -> "BatchLayout":
        """Consecutive segments: adapter ``names[i]`` gets the next ``sizes[i]`` rows; ``num_rows`` (default their
        sum) may leave rows after them to the base alone (PEFT's ``"__base__"`` rows)."""
        if isinstance(names, str):
            raise ValueError(f"BatchLayout.from_sizes: `names` must be a sequence of adapter names, got the string "
                             f"{names!r} (a list of one name: [{names!r}])")
        names, sizes = list(names), list(sizes)
        if len(names) != len(sizes):
            raise ValueError(f"BatchLayout.from_sizes: `names` and `sizes` must have the same length, got "
                             f"{len(names)} names and {len(sizes)} sizes")
        starts, ends, offset = [], [], 0
        for size in sizes:
            if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
                raise ValueError(f"BatchLayout.from_sizes: `sizes` must be integers >= 0, got {sizes}")
            starts.append(offset)
            offset += size
            ends.append(offset)
        if num_rows is not None and (isinstance(num_rows, bool) or not isinstance(num_rows, numbers.Integral)
                                     or num_rows < offset):
            raise ValueError(f"BatchLayout.from_sizes: `num_rows` must be an integer >= the sizes' sum {offset}, got "
                             f"{num_rows!r}")
        return cls(tuple(names), tuple(starts), tuple(ends), offset if num_rows is None else num_rows, padding_side)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in zip(self.starts, self.ends))

    def keeping(self, names: Collection[str]) -> "BatchLayout":
        """This layout with only the adapters in ``names``; the others' rows left to the base alone (itself where it
        keeps them all)."""
        keep = [i for i, n in enumerate(self.names) if n in names]
        if len(keep) == len(self.names):
            return self
        return BatchLayout(tuple(self.names[i] for i in keep), tuple(self.starts[i] for i in keep),
                           tuple(self.ends[i] for i in keep), self.num_rows, self.padding_side)
