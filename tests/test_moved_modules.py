"""Every public name keeps the import path it had before the package's re-layout."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

# Old path -> (new home, the public names the old path had).
MOVED: dict[str, tuple[str, tuple[str, ...]]] = {
    "otel_agentcap.processor": (
        "otel_agentcap.pipeline.processor",
        (
            "MODEL_OPERATIONS",
            "AgentCapSpanProcessor",
            "SpanClassifier",
            "classify_genai_span",
            "has_agentcap_processor",
            "span_processors_of",
        ),
    ),
    "otel_agentcap.stamping": ("otel_agentcap.pipeline.stamping", ("Stamp", "stamp")),
    "otel_agentcap.mapping": (
        "otel_agentcap.pipeline.mapping",
        (
            "SpanCheck",
            "SpanLike",
            "SpanRejected",
            "agents_from_span",
            "batch_from_spans",
            "declared_run_attributes",
            "events_from_span",
            "span_record",
            "wall_time",
        ),
    ),
    "otel_agentcap.model_calls": (
        "otel_agentcap.pipeline.model_calls",
        (
            "CONTENT_ATTRIBUTES",
            "CONTENT_PREFIXES",
            "PAYLOAD_SCHEMA",
            "SDK_SCOPE",
            "OUTPUT_MESSAGES",
            "STOP_REASON",
            "SUPERSEDED",
            "TOOL_USE_IDS",
            "call_ids",
            "is_content_attribute",
            "is_sdk_scope",
            "model_call_payload",
            "status_of",
            "usage_of",
        ),
    ),
    "otel_agentcap.span_attributes": (
        "otel_agentcap.pipeline.span_attributes",
        ("add_attributes", "attributes_of", "has_events"),
    ),
    "otel_agentcap.causal_links": (
        "otel_agentcap.pipeline.causal_links",
        (
            "MAX_ENTRIES",
            "clear",
            "forget_run",
            "model_call_for_response",
            "model_call_for_tool_use",
            "new_tool_result_ids",
            "record_model_call",
            "record_tool_result",
            "request_parents",
            "tool_result_for",
        ),
    ),
    "otel_agentcap.timeline": (
        "otel_agentcap.cli.timeline",
        ("Line", "Totals", "event_positions", "layout", "parent_text", "summary", "totals"),
    ),
    "otel_agentcap.tool_uses": (
        "otel_agentcap.capture.tool_uses",
        (
            "ToolSet",
            "arun_tool_uses",
            "remember_tool_result",
            "run_tool_uses",
            "sdk_tools_exactly_once",
            "set_sdk_tools_exactly_once",
            "tool_use_blocks",
            "tool_use_scope",
        ),
    ),
}

# Interfaces now defined in otel_agentcap.protocols, still importable from their old modules.
PROTOCOLS: dict[str, tuple[str, ...]] = {
    "otel_agentcap.clock": ("SequenceSource",),
    "otel_agentcap.capture.ledger": (
        "CRASH_POLICIES",
        "DEFAULT_CRASH_POLICY",
        "ClaimState",
        "Codec",
        "CrashPolicy",
        "LedgerCall",
        "LedgerClaim",
        "ToolLedger",
    ),
    "otel_agentcap.capture.agents": ("SpawnClaim", "SpawnLookup", "SpawnRecord", "SpawnRegistry"),
    "otel_agentcap.capture.runs": ("RunRegistry", "StoredRun"),
    "otel_agentcap.capture.memory": ("Lookup", "MemoryBase"),
    "otel_agentcap.pipeline.mapping": ("SpanCheck", "SpanLike"),
    "otel_agentcap.exporters.durable.host_sequences": ("SequenceSource",),
    "otel_agentcap.exporters.postgres.writer": ("ConnectionSource",),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_gives_the_same_objects(old: str) -> None:
    """Each name the old module had is importable from it, and is the object of its new home."""
    new, names = MOVED[old]
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(old_module, name) is getattr(new_module, name), f"{old}.{name}"


@pytest.mark.parametrize("module", sorted(PROTOCOLS))
def test_interfaces_keep_their_old_module(module: str) -> None:
    """The interfaces gathered in otel_agentcap.protocols are still importable where they were."""
    protocols = importlib.import_module("otel_agentcap.protocols")
    old = importlib.import_module(module)
    for name in PROTOCOLS[module]:
        assert getattr(old, name) is getattr(protocols, name), f"{module}.{name}"


def test_command_line_package_keeps_the_old_modules_names() -> None:
    """otel_agentcap.cli was one module: the package re-exports every public name of its
    commands module."""
    import otel_agentcap.cli
    from otel_agentcap.cli import commands

    defined: list[str] = []
    for node in ast.parse(Path(commands.__file__).read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined += [t.id for t in targets if isinstance(t, ast.Name)]
    public = sorted(name for name in defined if not name.startswith("_"))
    assert "main" in public
    for name in public:
        assert getattr(otel_agentcap.cli, name) is getattr(commands, name), name


def test_command_line_keeps_its_entry_points() -> None:
    """The console script still names otel_agentcap.cli:main, and python -m otel_agentcap.cli
    runs the command."""
    [script] = [e for e in entry_points(group="console_scripts") if e.name == "otel-agentcap"]
    assert script.value == "otel_agentcap.cli:main"
    from otel_agentcap.cli import EXPORT_FORMATS, main
    from otel_agentcap.cli.commands import main as commands_main

    assert script.load() is main is commands_main
    assert "agentcap-pb" in EXPORT_FORMATS
    done = subprocess.run(
        [sys.executable, "-m", "otel_agentcap.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "otel-agentcap" in done.stdout
