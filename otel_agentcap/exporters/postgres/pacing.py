"""How a thread that maps spans for the writers gives them the GIL now and then: it calls a
pause (``WriterThreads.pause``: a short sleep while a writer is storing) between slices of its
work, so that a writer whose server answered runs at once instead of after the interpreter's
switch interval."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final, TypeVar

_T = TypeVar("_T")

#: Items a mapping thread handles between two calls of its pause (about 1 ms of work).
PAUSE_EVERY: Final = 32


def paced(items: Iterable[_T], pause: Callable[[], None] | None) -> Iterator[_T]:
    """``items``, with ``pause`` called before every ``PAUSE_EVERY``-th of them (never when it
    is None)."""
    if pause is None:
        yield from items
        return
    countdown = PAUSE_EVERY
    for item in items:
        countdown -= 1
        if not countdown:
            countdown = PAUSE_EVERY
            pause()
        yield item
