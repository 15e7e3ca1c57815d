"""Private copies of values: what a tool replay hands out and what memory keeps and returns, so
that nobody can change a recorded value in place behind the log's back."""

from __future__ import annotations

import copy
import logging
import marshal
from typing import Any, Final

_logger = logging.getLogger(__name__)

_IMMUTABLE: Final = frozenset({str, int, float, bool, bytes, complex, type(None), range})
#: Items a private copy of plain data copies by hand before it leaves the value to
#: ``copy.deepcopy`` (shared sub-containers are copied once per reference, so a budget bounds it).
_PLAIN_BUDGET: Final = 10_000
_PLAIN_DEPTH: Final = 32


class _NotPlain(Exception):
    pass


def _copy_plain(value: Any, budget: list[int], depth: int, memo: dict[int, Any]) -> Any:
    """A copy of ``value`` made of dicts, lists and tuples of immutable values; raises _NotPlain
    for anything else (or when the budget or depth runs out). A container reached twice is copied
    once (``memo``, by id, as ``copy.deepcopy`` does), so the copy shares what the value shared."""
    cls = type(value)
    if cls is not dict and cls is not list and cls is not tuple:
        raise _NotPlain
    copied_before = memo.get(id(value))
    if copied_before is not None:
        return copied_before
    budget[0] -= len(value)
    if budget[0] < 0 or depth > _PLAIN_DEPTH:
        raise _NotPlain
    immutable = _IMMUTABLE
    if cls is dict:
        out: dict[Any, Any] = {}
        memo[id(value)] = out
        for key, item in value.items():
            if type(item) not in immutable:
                item = _copy_plain(item, budget, depth + 1, memo)
            out[key] = item
        return out
    if cls is list:
        copied = value[:]
        memo[id(value)] = copied
        for index, item in enumerate(copied):
            if type(item) not in immutable:
                copied[index] = _copy_plain(item, budget, depth + 1, memo)
        return copied
    for item in value:  # a tuple: copied only if it holds something mutable
        if type(item) not in immutable:
            out_tuple = tuple(
                [
                    x if type(x) in immutable else _copy_plain(x, budget, depth + 1, memo)
                    for x in value
                ]
            )
            memo[id(value)] = out_tuple
            return out_tuple
    return value


def private_copy(value: Any) -> Any:
    """A deep copy of ``value`` that nobody else holds: what a replay hands out and what the
    registry and memory keep. Plain data (dicts, lists, tuples of scalars) is copied by hand;
    anything else by ``copy.deepcopy``. A value that cannot be copied is returned as it is (and
    then shared: documented for tool results and memory values)."""
    cls = type(value)
    if cls in _IMMUTABLE:
        return value
    if cls is dict and len(value) <= _PLAIN_BUDGET:
        # _copy_plain's first level, inlined for the usual tool result: a dict, whose containers
        # (copied by _copy_plain) start the memo and the budget.
        try:
            out: dict[Any, Any] = {}
            memo: dict[int, Any] | None = None
            budget = [_PLAIN_BUDGET - len(value)]
            immutable = _IMMUTABLE
            for key, item in value.items():
                if type(item) not in immutable:
                    if memo is None:
                        memo = {id(value): out}
                    item = _copy_plain(item, budget, 1, memo)
                out[key] = item
            return out
        except (_NotPlain, RecursionError):
            pass
    elif cls is dict or cls is list or cls is tuple:
        try:
            return _copy_plain(value, [_PLAIN_BUDGET], 0, {})
        except (_NotPlain, RecursionError):
            pass
    try:
        return copy.deepcopy(value)
    except Exception:
        _logger.debug("agentcap: a %s cannot be copied; it is shared", type(value).__name__)
        return value


def frozen(value: Any) -> bytes | None:
    """``value`` as bytes that :func:`thawed` turns into a new private copy, each time it is
    called, or None. Only for a value that json's own encoder took as it is
    (``jsonsafe.dumps_plain``), which holds nothing but dicts, lists, tuples, str, int, float,
    True, False and None or instances of their subclasses: ``marshal`` refuses the subclasses, so
    the bytes stand for plain data exactly (types, key order, and containers shared within the
    value stay shared). It would write any other bytes-like object as bytes, hence the
    precondition. Cheaper than :func:`private_copy`: the copying is done in C."""
    try:
        return marshal.dumps(value)
    except Exception:  # ValueError: a subclass, or nested too deeply
        return None


thawed = marshal.loads
"""A new copy of the value :func:`frozen` gave bytes for."""
