"""Imports go one way through the package's layers, in the order the data flows through them."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import otel_agentcap

PACKAGE_DIR = Path(otel_agentcap.__file__).parent
ROOT = "otel_agentcap"

# Lowest first. A module may import from its own group and from lower layers; the groups of one
# layer are independent of each other. A module belongs to the group with the longest prefix that
# names it (a prefix names a module and everything under it).
LAYERS: tuple[tuple[tuple[str, ...], ...], ...] = (
    # Data and rules everything shares: no I/O of its own, no OpenTelemetry SDK.
    (
        (
            "attributes",
            "errors",
            "forks",
            "jsonsafe",
            "lazy_exports",
            "model",
            "private_parts",
            "protocols",
            "runs",
            "validation",
            "version",
            "_proto",
        ),
    ),
    # State of the running program: Lamport clocks, run and agent context.
    (("clock", "context"),),
    # The pipeline's first stage, called where a span starts (by capture too): event identity,
    # span attribute access, the registries where model calls and tool results meet.
    (("pipeline.stamping", "pipeline.span_attributes", "pipeline.causal_links"),),
    # The capture API (the package's root re-exports it). Needs only opentelemetry-api.
    (("capture", ""),),
    # The span processor and the mapping of spans to events.
    (("pipeline",),),
    # Instrumentations: they record spans, and add the span processor where it is missing.
    (("instrumentation",),),
    # Storage: the exporters and the PostgreSQL event log.
    (("exporters",),),
    # The HTTP server (Hypercorn) that the ingest and the web view run on, and their bearer tokens.
    (("serving", "tokens"),),
    # What reads the log or writes it from outside the process.
    (("ingest",), ("viewer",)),
    (("transfer",),),
    # Composition: test support, the one-call setup, the distro, the demo, the command line.
    (("testing",),),
    (("configure",),),
    (("distro",), ("demo",)),
    (("cli",),),
)

# The modules' old paths: re-exports of their new homes for user code, imported by no module of
# the package (tests/test_moved_modules.py checks them).
MOVED: Mapping[str, str] = {
    "otel_agentcap.processor": "otel_agentcap.pipeline.processor",
    "otel_agentcap.stamping": "otel_agentcap.pipeline.stamping",
    "otel_agentcap.mapping": "otel_agentcap.pipeline.mapping",
    "otel_agentcap.model_calls": "otel_agentcap.pipeline.model_calls",
    "otel_agentcap.span_attributes": "otel_agentcap.pipeline.span_attributes",
    "otel_agentcap.causal_links": "otel_agentcap.pipeline.causal_links",
    "otel_agentcap.timeline": "otel_agentcap.cli.timeline",
    "otel_agentcap.tool_uses": "otel_agentcap.capture.tool_uses",
}

# Layers up to the capture API need only opentelemetry-api (the SDK is optional for them).
API_ONLY_LAYERS = 4


def _module_names() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = (ROOT, *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """Every module ``module`` imports, anywhere in it (functions and TYPE_CHECKING blocks too),
    with the line of the import."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                yield (submodule if submodule in known else source), node.lineno


def import_graph() -> dict[str, list[tuple[str, int]]]:
    """The package's modules (old paths left out) and what each imports, with line numbers."""
    modules = _module_names()
    known = set(modules)
    return {
        module: list(_imports(module, path, known))
        for module, path in modules.items()
        if module not in MOVED
    }


def place(module: str) -> tuple[int, int] | None:
    """The (layer, group) of ``module``, or None when no group names it."""
    best: tuple[int, tuple[int, int]] | None = None
    for layer, groups in enumerate(LAYERS):
        for group, prefixes in enumerate(groups):
            for prefix in prefixes:
                name = f"{ROOT}.{prefix}" if prefix else ROOT
                named = module == name or (bool(prefix) and module.startswith(name + "."))
                if named and (best is None or len(name) > best[0]):
                    best = (len(name), (layer, group))
    return None if best is None else best[1]


def _label(placed: tuple[int, int]) -> str:
    prefix = LAYERS[placed[0]][placed[1]][0]
    return f"{ROOT}.{prefix}" if prefix else ROOT


def violations(graph: Mapping[str, list[tuple[str, int]]]) -> list[str]:
    found = []
    for module, imports in graph.items():
        here = place(module)
        for target, line in imports:
            if target == module or not (target == ROOT or target.startswith(ROOT + ".")):
                continue
            there = place(target)
            if here is None or there is None:
                continue  # test_every_module_has_a_layer reports it
            if there[0] < here[0] or there == here:
                continue
            found.append(f"{module}:{line} imports {target} ({_label(there)} over {_label(here)})")
    return found


def test_every_module_has_a_layer():
    """Every module of the package belongs to a layer, so a new module is placed on purpose."""
    unplaced = [m for m in import_graph() if place(m) is None]
    assert unplaced == []


def test_imports_go_one_way():
    """No module imports from a layer above its own, nor from another group of its layer."""
    assert violations(import_graph()) == []


def test_a_back_edge_is_reported():
    """The check reports capture importing storage, the pipeline importing the command line, and
    the ingest importing the web view."""
    graph = {
        "otel_agentcap.capture.tools": [("otel_agentcap.exporters.postgres.store", 3)],
        "otel_agentcap.pipeline.mapping": [("otel_agentcap.cli.commands", 5)],
        "otel_agentcap.ingest.service": [("otel_agentcap.viewer.app", 7)],
        "otel_agentcap.exporters.postgres.rows": [("otel_agentcap.pipeline.model_calls", 9)],
    }
    assert [v.split(" ")[0] for v in violations(graph)] == [
        "otel_agentcap.capture.tools:3",
        "otel_agentcap.pipeline.mapping:5",
        "otel_agentcap.ingest.service:7",
    ]


def test_no_module_imports_an_old_path():
    """Modules of the package import the moved modules from their new homes."""
    used = [
        f"{module}:{line} imports {target}"
        for module, imports in import_graph().items()
        for target, line in imports
        if target in MOVED
    ]
    assert used == []


def test_capture_needs_only_the_api():
    """The capture API and what it imports never import the OpenTelemetry SDK."""
    sdk = [
        f"{module}:{line}"
        for module, imports in import_graph().items()
        if (p := place(module)) is not None and p[0] < API_ONLY_LAYERS
        for target, line in imports
        if target == "opentelemetry.sdk" or target.startswith("opentelemetry.sdk.")
    ]
    assert sdk == []
