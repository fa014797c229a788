"""A generative decoder recognised from its signature: token ids in, logits out, and a key/value cache that
goes in as ``past`` and comes back one position longer as ``present``.

The names are those the common exporters write: Hugging Face ``optimum`` and torch's dynamo export of a
model with ``use_cache`` (``past_key_values.{layer}.key`` / ``.value`` in, ``present.{layer}.key`` /
``.value`` out), and ONNX Runtime GenAI's model builder (the same, or ``present_key_values``). The cache
tensors are ``[batch, heads, positions, head_dim]``. ``attention_mask`` ([batch, past + new]) and
``position_ids`` ([batch, new]) are optional inputs; a decoder with both can decode sequences of different
lengths as one batch (the shorter ones' cache padded and masked).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .indices import IndexBounds
from .signature import Signature, TensorSpec

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"^present(?:_key_values)?\.(\d+)\.(key|value)$")
TOKEN_INPUTS = ("input_ids", "ids")
MASK_INPUT = "attention_mask"
POSITION_INPUT = "position_ids"


@dataclass(frozen=True)
class DecoderSpec:
    """What a decoder takes and gives, by name, and the shape of its cache."""

    tokens: str
    logits: str
    past: tuple[tuple[str, str], ...]
    """Per layer, the (key, value) cache inputs."""
    present: tuple[tuple[str, str], ...]
    """Per layer, the (key, value) cache outputs, in the order of ``past``."""
    heads: int
    head_dim: int
    cache_dtype: str
    vocab: int
    mask: str | None
    positions: str | None
    max_positions: int | None
    """The positions the model has (its position table's rows); None where nothing bounds them."""

    @property
    def layers(self) -> int:
        return len(self.past)

    @property
    def batches_by_mask(self) -> bool:
        """Sequences of different lengths decode as one batch: their cache padded, the padding masked."""
        return self.mask is not None and self.positions is not None

    def cache_bytes_per_position(self) -> int:
        """The key and value bytes one position of one sequence holds, over every layer."""
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(self.cache_dtype, 4)
        return 2 * self.layers * self.heads * self.head_dim * itemsize

    def describe(self) -> dict:
        return {
            "tokens": self.tokens,
            "logits": self.logits,
            "layers": self.layers,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "cache_dtype": self.cache_dtype,
            "vocab": self.vocab,
            "attention_mask": self.mask,
            "position_ids": self.positions,
            "max_positions": self.max_positions,
            "batches_sequences_of_different_lengths": self.batches_by_mask,
            "cache_bytes_per_token": self.cache_bytes_per_position(),
        }


def _pairs(specs: tuple[TensorSpec, ...], pattern: re.Pattern) -> dict[int, dict[str, TensorSpec]]:
    found: dict[int, dict[str, TensorSpec]] = {}
    for spec in specs:
        match = pattern.match(spec.name)
        if match:
            found.setdefault(int(match.group(1)), {})[match.group(2)] = spec
    return found


def recognize_decoder(signature: Signature, bounds: IndexBounds | None = None) -> DecoderSpec | None:
    """The decoder ``signature`` is, or None where it is not one (no past/present cache pairs, or pairs that
    do not match up). ``bounds``: the model's index inputs' ranges (its vocabulary and position table)."""
    past, present = _pairs(signature.inputs, _PAST), _pairs(signature.outputs, _PRESENT)
    layers = sorted(past)
    if not layers or layers != list(range(len(layers))) or sorted(present) != layers:
        return None
    if any(set(past[i]) != {"key", "value"} or set(present[i]) != {"key", "value"} for i in layers):
        return None
    names = set(signature.input_names)
    tokens = next((name for name in TOKEN_INPUTS if name in names), None)
    cache_names = {spec.name for pair in past.values() for spec in pair.values()}
    others = names - cache_names - {tokens, MASK_INPUT, POSITION_INPUT}
    if tokens is None or others:
        return None
    outputs = [name for name in signature.output_names if not _PRESENT.match(name)]
    logits = "logits" if "logits" in outputs else (outputs[0] if len(outputs) == 1 else None)
    if logits is None:
        return None
    key = past[0]["key"]
    if key.rank != 4:
        return None
    heads, head_dim = key.dims[1], key.dims[3]
    vocab = signature.outputs[signature.output_names.index(logits)].dims[-1]
    if not all(isinstance(d, int) for d in (heads, head_dim, vocab)):
        return None
    limits = bounds.limits if bounds else {}
    return DecoderSpec(
        tokens=tokens,
        logits=logits,
        past=tuple((past[i]["key"].name, past[i]["value"].name) for i in layers),
        present=tuple((present[i]["key"].name, present[i]["value"].name) for i in layers),
        heads=heads,
        head_dim=head_dim,
        cache_dtype=key.dtype,
        vocab=vocab,
        mask=MASK_INPUT if MASK_INPUT in names else None,
        positions=POSITION_INPUT if POSITION_INPUT in names else None,
        max_positions=limits.get(POSITION_INPUT),
    )
