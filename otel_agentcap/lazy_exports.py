"""Names a package re-exports, imported on first use (PEP 562).

Importing one module of a package runs the package's ``__init__`` first; with every re-export
imported there, ``otel-agentcap --help`` imported the OpenTelemetry SDK, asyncio and the whole
capture layer before it printed a line. A package lists its re-exports here instead, and keeps
the same imports under ``TYPE_CHECKING`` for type checkers and readers.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps a name to the module
    that defines it. A name is imported once, then kept in the package's namespace.

    A name must not be the name of one of the package's submodules: importing the submodule
    binds its name in the package first, and ``__getattr__`` would never be asked.
    """
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
