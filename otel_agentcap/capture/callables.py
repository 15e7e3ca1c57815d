"""What calling a user's callable runs its body as: now, or later (a coroutine or generator that
runs only when its caller awaits or iterates it, after the call itself has returned)."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, Literal

BodyKind = Literal["plain", "coroutine", "generator", "async generator"]


def body_kind(fn: Callable[..., Any]) -> BodyKind:
    """What calling ``fn`` runs its body as, looking through ``functools.partial`` and into the
    ``__call__`` of a callable object. A sync function that returns a coroutine (a wrapper around
    an async function) is "plain" here: only its result tells."""
    target: Any = fn
    while isinstance(target, functools.partial):
        target = target.func
    if callable(target) and not inspect.isroutine(target) and not isinstance(target, type):
        target = type(target).__call__
    if inspect.iscoroutinefunction(target):
        return "coroutine"
    if inspect.isasyncgenfunction(target):
        return "async generator"
    if inspect.isgeneratorfunction(target):
        return "generator"
    return "plain"


def deferred_kind(result: object) -> str | None:
    """ "coroutine", "generator" or "async generator" when ``result`` is a body yet to run."""
    cls = type(result)
    if cls is types.CoroutineType:
        return "coroutine"
    if cls is types.GeneratorType:
        return "generator"
    if cls is types.AsyncGeneratorType:
        return "async generator"
    return None


def close_unrun(result: object) -> None:
    """Close a body that never ran (a coroutine or generator returned by a sync wrapper), so it
    neither warns that it was never awaited nor runs later. An async generator not yet iterated
    has nothing to close (and no ``close``)."""
    close = getattr(result, "close", None)
    if callable(close):
        close()
