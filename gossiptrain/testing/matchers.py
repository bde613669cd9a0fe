"""Matchers for the action lists that sans-IO state machines return.

``Membership.handle(event, now)`` (and the other protocol machines) answer
with a list of actions; a test usually cares about the actions of one type,
or about one of them with certain fields. In the spirit of dask's
``Instruction.match``::

    assert only(node.handle(Tick(), now), Send, kind=PING)      # some ping was sent
    assert not only(actions, MemberDown, reason="dead")          # nobody was declared dead
    pings = [a.addr for a in only(actions, Send, kind=PING)]

Fields are compared with ``==``. A name that is not a field of the
(dataclass) type is a ``TypeError``, so that a misspelt name cannot make
``not only(...)`` pass vacuously.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, TypeVar

__all__ = ["match", "only"]

T = TypeVar("T")


def _check_fields(cls: type, fields: dict[str, Any]) -> None:
    """Refuse names that are not fields of ``cls`` (a dataclass, as protocol actions are).

    Other types are not checked up front; a missing attribute raises
    ``AttributeError`` when an action of that type is compared.
    """
    if not dataclasses.is_dataclass(cls):
        return
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))}")


def match(action: object, cls: type, /, **fields: Any) -> bool:
    """Whether ``action`` is a ``cls`` (``isinstance``) whose named fields equal the given values.

    The first two parameters are positional-only, so that any field name
    (``kind``, ``action``, ``cls``) can be matched.
    """
    _check_fields(cls, fields)
    return isinstance(action, cls) and all(getattr(action, k) == v for k, v in fields.items())


def only(actions: Iterable[object], cls: type[T], /, **fields: Any) -> list[T]:
    """The actions that ``match``, in their order (empty, hence falsy, if none do)."""
    _check_fields(cls, fields)
    return [a for a in actions if isinstance(a, cls) and all(getattr(a, k) == v for k, v in fields.items())]
