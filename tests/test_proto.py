"""The committed generated code of the event-log schema matches what the pinned generator writes,
and reads what export writes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location(
        "generate_proto", ROOT / "scripts" / "generate_proto.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["generate_proto"] = module
    spec.loader.exec_module(module)
    return module


def test_committed_generated_code_is_up_to_date():
    """Regenerating proto/ with the pinned grpcio-tools gives the committed files byte for byte."""
    assert _generator().stale_files() == []


def test_a_stale_generated_file_is_detected(tmp_path, monkeypatch):
    """A generated file that differs from the generator's output is reported as stale."""
    generator = _generator()
    for name in ("eventlog_pb2.py", "eventlog_pb2.pyi"):
        (tmp_path / name).write_bytes((generator.TARGET / name).read_bytes())
    (tmp_path / "eventlog_pb2.py").write_bytes(b"# edited by hand\n")
    monkeypatch.setattr(generator, "TARGET", tmp_path)
    monkeypatch.setattr(generator, "ROOT", tmp_path.parent)
    assert [Path(p).name for p in generator.stale_files()] == ["eventlog_pb2.py"]


def test_the_package_name_carries_the_schema_version():
    """The schema's protobuf package is versioned (agentcap.eventlog.v1)."""
    from otel_agentcap._proto import eventlog_pb2

    assert eventlog_pb2.Batch.DESCRIPTOR.full_name == "agentcap.eventlog.v1.Batch"
    names = {m.name for m in eventlog_pb2.DESCRIPTOR.message_types_by_name.values()}
    assert names >= {"Run", "Agent", "Event", "Conflict", "Batch", "Span"}


def test_the_generator_is_pinned_in_the_dev_extra():
    """The generator the script names is the one pyproject's dev extra pins."""
    pytest.importorskip("grpc_tools")
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"{_generator().GENERATOR}"' in text
