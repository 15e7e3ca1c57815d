"""Packages import what they re-export on first use, and every re-export is the object named."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from types import ModuleType

import pytest

import otel_agentcap
import otel_agentcap.exporters.postgres

LAZY_PACKAGES = (otel_agentcap, otel_agentcap.exporters.postgres)


def _import_every_submodule(package: ModuleType) -> None:
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if ".cli.__main__" in info.name:
            continue  # runs the command line
        importlib.import_module(info.name)


@pytest.mark.parametrize("package", LAZY_PACKAGES, ids=lambda p: p.__name__)
def test_every_export_is_the_object_its_module_defines(package: ModuleType) -> None:
    """After every submodule is imported (which binds submodule names in the package), each name
    in __all__ is still the object of the module it comes from, not a submodule."""
    _import_every_submodule(package)
    exports: dict[str, str] = package._EXPORTS
    for name in package.__all__:
        value = getattr(package, name)
        assert not isinstance(value, ModuleType), name
        if name in exports:
            assert value is getattr(importlib.import_module(exports[name]), name), name
    assert set(exports) <= set(package.__all__)
    assert set(package.__all__) <= set(dir(package))


def test_an_unknown_name_is_an_attribute_error() -> None:
    """A name the package does not export raises AttributeError naming it."""
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = otel_agentcap.no_such_name  # type: ignore[attr-defined]


def test_the_command_line_does_not_import_the_sdk_or_the_capture_layer() -> None:
    """Importing the command line (what every otel-agentcap command does before it runs) leaves
    out the OpenTelemetry SDK and the capture API: they cost the read commands a third of their
    start-up."""
    code = (
        "import sys, otel_agentcap.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith("
        "('opentelemetry.sdk', 'otel_agentcap.capture', 'otel_agentcap.exporters.postgres.exporter'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
