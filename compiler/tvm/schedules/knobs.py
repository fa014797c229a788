"""The rules' choices as knobs a tuner can turn.

Each decision a rule makes from a measured rule of thumb (run a loop nest in parallel or not, the
register tile's rows and lanes, flatten a pointwise map, pack a weight panel) is read through
:func:`choose`, which names the decision, the rule's own choice and the alternatives that are as
correct. Outside a :func:`knob_session` it returns the rule's choice, so compiles are what they
were. Within one, a tuning candidate may override any knob by name, and the session records what
the rule offered (``offered``): the task's own design space, searched by ``compiler.tvm.knob_search``.

Every alternative computes what the default computes: the schedule primitives check their own
preconditions, and a choice they refuse makes the rule decline (the candidate is dropped).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

Knob = str | int | bool


@dataclass
class KnobSession:
    """Overrides for one scheduling of one function, and the knobs the rules offered while it ran."""

    overrides: dict[str, Knob] = field(default_factory=dict)
    offered: dict[str, tuple[Knob, tuple[Knob, ...]]] = field(default_factory=dict)
    """Knob name -> (the rule's choice, the alternatives), in the order the rules read them."""
    used: set[str] = field(default_factory=set)
    """The overrides a rule applied (one a rule never reached changed nothing)."""


_SESSION: ContextVar[KnobSession | None] = ContextVar("jitserve_knob_session", default=None)


def choose(name: str, default: Knob, alternatives: Sequence[Knob] = ()) -> Knob:
    """The value of the knob ``name``: the rule's ``default``, or a tuning candidate's override (one of
    ``alternatives``; an override outside them is ignored)."""
    session = _SESSION.get()
    if session is None:
        return default
    others = tuple(dict.fromkeys(a for a in alternatives if a != default))
    session.offered.setdefault(name, (default, others))
    value = session.overrides.get(name, default)
    if value != default and value in others:
        session.used.add(name)
        return value
    return default


@contextmanager
def knob_session(overrides: dict[str, Knob] | None = None) -> Iterator[KnobSession]:
    """Rules scheduling within this read ``overrides`` through :func:`choose`."""
    session = KnobSession(dict(overrides or {}))
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)
