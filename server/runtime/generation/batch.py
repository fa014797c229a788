"""The running sequences of a decoder that takes ``attention_mask`` and ``position_ids``, held as one batch
between steps: each layer's cache one ``[batch, heads, positions, head_dim]`` tensor, the shorter sequences
padded at the front and the padding masked. A step hands the batch's cache to the model as ``past`` and keeps
the ``present`` it returns as the next step's cache: nothing is gathered or scattered per step. The batch is
rebuilt only as sequences join (padded to the longest) or leave (their rows dropped, and the padding no
sequence needs any more trimmed). Sequences of very different lengths run as batches of their own
(:class:`GroupedBatches`)."""

from __future__ import annotations

import numpy as np

from compiler.models.decoder import DecoderSpec

PADDING_SHARE = 0.2
"""A batch's padding may be this share of the positions its sequences hold (and a block a row); a sequence that
would pad it further decodes in a batch of its own: a 1,000-position sequence beside a 10-position one would
double the cache's memory and the short one's attention."""


class RunningBatch:
    def __init__(self, spec: DecoderSpec) -> None:
        self.spec = spec
        self.sequences: list = []
        self.cache: dict[str, np.ndarray] = {}
        """Past input name -> ``[batch, heads, positions, head_dim]``."""
        self.mask = np.zeros((0, 0), dtype=np.int64)
        """``[batch, positions]``: 1 where a row's position holds its cache, 0 where it is padding."""

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def positions(self) -> int:
        return self.mask.shape[1]

    def live_positions(self) -> int:
        """The positions its rows hold, padding not counted."""
        return int(self.mask.sum())

    def takes(self, length: int, slack: int) -> bool:
        """Whether a sequence of ``length`` positions may join: the padding after it stays within
        :data:`PADDING_SHARE` of the positions the rows hold, plus ``slack`` positions a row."""
        rows = len(self.sequences) + 1
        live = self.live_positions() + length
        return rows * max(self.positions, length) - live <= PADDING_SHARE * live + slack * rows

    def padded_bytes(self) -> int:
        """What the batch's cache holds, padding included."""
        return sum(array.nbytes for array in self.cache.values())

    def join(self, sequence, cache: dict[str, np.ndarray]) -> None:
        """Add a prefilled sequence whose cache (``[1, heads, length, head_dim]`` per past input) is ``cache``."""
        length = next(iter(cache.values())).shape[2]
        if not self.sequences:
            self.sequences, self.cache = [sequence], dict(cache)
            self.mask = np.ones((1, length), dtype=np.int64)
            return
        longest = max(self.positions, length)
        self.cache = {
            name: np.concatenate([_front_padded(self.cache[name], longest), _front_padded(cache[name], longest)])
            for name in self.cache
        }
        row = np.zeros((1, longest), dtype=np.int64)
        row[0, longest - length :] = 1
        self.mask = np.concatenate([_front_padded(self.mask, longest), row])
        self.sequences.append(sequence)

    def leave(self, gone: list) -> None:
        """Drop ``gone``'s rows, and the front positions only they held."""
        if not gone:
            return
        keep = [row for row, sequence in enumerate(self.sequences) if sequence not in gone]
        self.sequences = [self.sequences[row] for row in keep]
        if not keep:
            self.cache, self.mask = {}, np.zeros((0, 0), dtype=np.int64)
            return
        mask = self.mask[keep]
        first = int(np.argmax(mask.any(axis=0)))  # the first position some sequence still holds
        self.mask = np.ascontiguousarray(mask[:, first:])
        self.cache = {name: np.ascontiguousarray(array[keep][:, :, first:]) for name, array in self.cache.items()}

    def feeds(self, tokens: list[int]) -> dict[str, np.ndarray]:
        """One decode step's inputs: each row's last token at its next position, the cache as it is."""
        spec, count = self.spec, len(self.sequences)
        feeds = {
            spec.tokens: np.array(tokens, dtype=np.int64).reshape(count, 1),
            spec.mask: np.concatenate([self.mask, np.ones((count, 1), dtype=np.int64)], axis=1),
            spec.positions: self.mask.sum(axis=1, keepdims=True),
        }
        feeds.update(self.cache)
        return feeds

    def step(self, run, tokens: list[int]) -> list[np.ndarray]:
        """One decode step of every row by ``run`` (the model's call): each row's logits. The step's
        ``present`` is the next step's cache; its mask, one position longer."""
        feeds = self.feeds(tokens)
        outputs = run(feeds)
        self.mask = feeds[self.spec.mask]
        self.cache = present_cache(self.spec, outputs)
        logits = outputs[self.spec.logits]
        return [logits[row, -1] for row in range(len(self.sequences))]


def _front_padded(array: np.ndarray, positions: int) -> np.ndarray:
    """``array`` with zeros before its positions axis (2 for a cache, 1 for a mask) up to ``positions``."""
    axis = 2 if array.ndim == 4 else 1
    missing = positions - array.shape[axis]
    if missing == 0:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (missing, 0)
    return np.pad(array, widths)


class GroupedBatches:
    """The running sequences as batches of similar lengths (:meth:`RunningBatch.takes`), each decoded by one call
    within the step: the cache holds its sequences' positions and at most a fifth more (and a block a row)."""

    def __init__(self, spec: DecoderSpec, block_positions: int) -> None:
        self.spec = spec
        self.block_positions = block_positions
        self.groups: list[RunningBatch] = []

    @property
    def sequences(self) -> list:
        return [sequence for group in self.groups for sequence in group.sequences]

    def __len__(self) -> int:
        return sum(len(group) for group in self.groups)

    def padded_bytes(self) -> int:
        return sum(group.padded_bytes() for group in self.groups)

    def join(self, sequence, cache: dict[str, np.ndarray]) -> None:
        length = next(iter(cache.values())).shape[2]
        group = next((g for g in self.groups if g.takes(length, self.block_positions)), None)
        if group is None:
            group = RunningBatch(self.spec)
            self.groups.append(group)
        group.join(sequence, cache)

    def leave(self, gone: list) -> None:
        for group in self.groups:
            group.leave([sequence for sequence in gone if sequence in group.sequences])
        self.groups = [group for group in self.groups if group.sequences]

    def step(self, run, tokens: list[int]) -> list[np.ndarray]:
        """Each group's step, the rows in :attr:`sequences`' order (``tokens`` in it too)."""
        rows, start = [], 0
        for group in self.groups:
            rows += group.step(run, tokens[start : start + len(group)])
            start += len(group)
        return rows


class SeparateSequences:
    """The running sequences of a decoder that cannot mask a padded cache (no ``attention_mask`` or
    ``position_ids``): each holds its own cache and is decoded by a call of its own within the step."""

    def __init__(self, spec: DecoderSpec) -> None:
        self.spec = spec
        self.sequences: list = []
        self._caches: dict[int, dict[str, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.sequences)

    def padded_bytes(self) -> int:
        return sum(array.nbytes for cache in self._caches.values() for array in cache.values())

    def join(self, sequence, cache: dict[str, np.ndarray]) -> None:
        self.sequences.append(sequence)
        self._caches[id(sequence)] = dict(cache)

    def leave(self, gone: list) -> None:
        for sequence in gone:
            self.sequences.remove(sequence)
            del self._caches[id(sequence)]

    def step(self, run, tokens: list[int]) -> list[np.ndarray]:
        rows = []
        for sequence, token in zip(self.sequences, tokens, strict=True):
            cache = self._caches[id(sequence)]
            feeds = {self.spec.tokens: np.array([[token]], dtype=np.int64), **cache}
            length = next(iter(cache.values())).shape[2]
            if self.spec.mask:
                feeds[self.spec.mask] = np.ones((1, length + 1), dtype=np.int64)
            if self.spec.positions:
                feeds[self.spec.positions] = np.array([[length]], dtype=np.int64)
            outputs = run(feeds)
            self._caches[id(sequence)] = present_cache(self.spec, outputs)
            rows.append(outputs[self.spec.logits][0, -1])
        return rows


def present_cache(spec: DecoderSpec, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A call's ``present`` outputs by the ``past`` input names they feed next."""
    return {
        past: outputs[present]
        for past_pair, present_pair in zip(spec.past, spec.present, strict=True)
        for past, present in zip(past_pair, present_pair, strict=True)
    }
