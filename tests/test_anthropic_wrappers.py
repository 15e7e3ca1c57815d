# ruff: noqa: F811  (pytest fixtures imported from anthropic_support)
"""The stream managers the instrumentation hands back offer the protocols of the SDK's own and no
other: a sync ``messages.stream(...)`` manager is no async context manager and an async one no
sync context manager, so code that picks ``with`` or ``async with`` by what a manager has, and a
wrong ``with``, behave as without the instrumentation."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import pytest
from anthropic_support import (  # noqa: F401 (fixtures)
    MODEL,
    USER,
    aclient,
    captured,
    client,
    instrumented,
    server,
)

pytestmark = pytest.mark.timeout(60)

SYNC_PROTOCOL = ("__enter__", "__exit__")
ASYNC_PROTOCOL = ("__aenter__", "__aexit__")


def _has(manager: Any, names: tuple[str, ...]) -> bool:
    return all(hasattr(manager, name) for name in names)


def _drain(*managers: Any) -> list[str]:
    """Enter async managers and read their streams, in one event loop (a manager's request is
    made when it is created, and must be awaited; the client's connections belong to a loop)."""

    async def read() -> list[str]:
        texts = []
        for manager in managers:
            async with manager as stream:
                texts.append(str(await stream.get_final_text()))
        return texts

    return asyncio.run(read())


def _streaming(client: Any) -> list[Any]:
    """The client's messages resources that have stream() (at the package's floor, anthropic
    0.40, the beta one has none)."""
    return [m for m in (client.messages, client.beta.messages) if hasattr(m, "stream")]


def test_sync_stream_manager_is_no_async_context_manager(client, instrumented):
    """client.messages.stream(...) and its beta have __enter__ but no __aenter__."""
    for messages in _streaming(client):
        manager = messages.stream(model=MODEL, max_tokens=64, messages=USER)
        assert _has(manager, SYNC_PROTOCOL)
        assert not any(hasattr(manager, name) for name in ASYNC_PROTOCOL)


def test_async_stream_manager_is_no_sync_context_manager(server, aclient, instrumented):
    """aclient.messages.stream(...) and its beta have __aenter__ but no __enter__."""
    managers = [
        messages.stream(model=MODEL, max_tokens=64, messages=USER)
        for messages in _streaming(aclient)
    ]
    has_sync = [hasattr(m, name) for m in managers for name in SYNC_PROTOCOL]
    has_async = [_has(m, ASYNC_PROTOCOL) for m in managers]
    assert all(_drain(*managers))
    assert all(has_async) and not any(has_sync)


def test_wrong_with_raises_the_type_error_python_raises(server, client, aclient, instrumented):
    """async with on a sync manager, and with on an async one, raise TypeError as uninstrumented."""
    manager = aclient.messages.stream(model=MODEL, max_tokens=64, messages=USER)
    with pytest.raises(TypeError), manager:  # type: ignore[attr-defined]
        pass
    assert all(_drain(manager))

    async def wrong() -> None:
        async with client.messages.stream(  # type: ignore[attr-defined]
            model=MODEL, max_tokens=64, messages=USER
        ):
            pass

    with pytest.raises(TypeError):
        asyncio.run(wrong())


def test_right_with_still_streams(server, client, aclient, captured, instrumented):
    """The managers still work with the right with, sync and async."""
    with client.messages.stream(model=MODEL, max_tokens=64, messages=USER) as stream:
        assert stream.get_final_text()

    assert all(_drain(aclient.messages.stream(model=MODEL, max_tokens=64, messages=USER)))
    assert isinstance(
        client.messages.stream(model=MODEL, max_tokens=64, messages=USER),
        anthropic.lib.streaming.MessageStreamManager,
    )
