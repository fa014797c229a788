"""How the next token is chosen from a step's logits: greedy, or sampled with temperature, top-k and top-p
from a seeded generator (one per sequence: a seed gives the same tokens whatever else is running)."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class SamplingParameters(BaseModel):
    """A generate request's ``parameters``."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1, description="tokens to generate at most")
    greedy: bool | None = Field(None, description="the most likely token each step (the default without temperature)")
    temperature: float = Field(0.0, ge=0, le=100, allow_inf_nan=False, description="0: greedy")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens (0: all)")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False, description="sample within this probability mass")
    seed: int | None = Field(None, ge=0, description="the sampling's seed (repeatable tokens)")
    stop: list[int] = Field(default_factory=list, description="token ids that end the sequence (kept in the output)")

    @property
    def samples(self) -> bool:
        return not self.greedy and self.temperature > 0


def next_token(logits: np.ndarray, parameters: SamplingParameters, rng: np.random.Generator) -> int:
    """The token chosen from one position's ``logits`` ([vocab])."""
    if not parameters.samples:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / parameters.temperature
    order = np.argsort(-scaled, kind="stable")
    if parameters.top_k:
        order = order[: parameters.top_k]
    chosen = scaled[order]
    probabilities = np.exp(chosen - chosen.max())
    probabilities /= probabilities.sum()
    if parameters.top_p < 1.0:  # the smallest head of the order whose mass reaches top_p
        keep = int(np.searchsorted(np.cumsum(probabilities), parameters.top_p)) + 1
        order, probabilities = order[:keep], probabilities[:keep] / probabilities[:keep].sum()
    return int(order[rng.choice(len(order), p=probabilities)])
