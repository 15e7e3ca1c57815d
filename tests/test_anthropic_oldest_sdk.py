"""The instrumentor's own spans on the oldest supported anthropic release (no tracing of its own).

The old release is installed with ``pip install --target`` into the pytest cache (once; reused
afterwards) and the scenario runs in a subprocess with that directory first on ``sys.path``, so it
works from a fresh clone in CI with PyPI access and never touches the development venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from otel_agentcap.instrumentation.anthropic.package import OLDEST_SUPPORTED

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).parent / "data" / "anthropic_oldest_sdk_script.py"
# anthropic 0.40 predates httpx 0.28's removal of `proxies`; its other dependencies come from the venv.
REQUIREMENTS = (
    f"anthropic=={OLDEST_SUPPORTED}",
    "httpx<0.28",
    "httpcore",
    "h11",
    "distro",
    "certifi",
    "idna",
)


@pytest.fixture(scope="module")
def oldest_sdk(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = getattr(pytestconfig, "cache", None)  # absent with -p no:cacheprovider
    name = f"anthropic-{OLDEST_SUPPORTED}"
    target = Path(cache.mkdir(name)) if cache is not None else tmp_path_factory.mktemp(name)
    if not (target / "anthropic" / "__init__.py").exists():
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(target),
                *REQUIREMENTS,
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        if result.returncode != 0:
            pytest.skip(f"could not install anthropic {OLDEST_SUPPORTED}: {result.stderr[-500:]}")
    return target


def test_instrumentor_spans_on_oldest_sdk(oldest_sdk: Path):
    """On anthropic 0.40 the instrumentor records every call kind once, with usage, errors and links."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(oldest_sdk), os.getcwd()])}
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["error_class"] == "InternalServerError"
    assert out["stream_error"] == "APIStatusError"
    assert all(name.startswith("chat ") for name in out["spans"] if "claude" in name)
    events = out["events"]
    calls = [e for e in events if e["type"] == "model_call"]
    # create, create(stream) exhausted, create(stream) dropped, messages.stream, 529, async x2
    assert len(calls) == 7
    first, streamed, dropped, helper, overloaded, mid_error, async_helper = (
        c["payload"] for c in calls
    )
    assert first["usage"] == {
        "input_tokens": 15,
        "output_tokens": 7,
        "cache_read_input_tokens": 5,
        "cache_creation_input_tokens": 0,
    }
    assert first["tool_use_ids"] == ["toolu_old"] and first["request_id"].startswith("req_")
    assert streamed["status"] == "ok" and streamed["usage"]["output_tokens"] == 87
    assert dropped["status"] == "unset" and "output_tokens" not in dropped["usage"]
    assert helper["status"] == "ok" and helper["stop_reason"] == "end_turn"
    assert overloaded["error_type"] == "overloaded_error"
    assert mid_error["status"] == "error" and mid_error["error_type"] == "overloaded_error"
    assert async_helper["status"] == "ok"
    # model -> tool -> model
    by_type = {e["type"]: e for e in events}
    assert calls[0]["id"] in by_type["tool_invocation"]["parents"]
    assert by_type["tool_result"]["id"] in calls[1]["parents"]
    assert "sk-old-SECRET" not in result.stdout


def test_raw_response_recorded_on_oldest_sdk(oldest_sdk: Path):
    """On anthropic 0.40 a with_raw_response call records its response: ids, usage, stop reason
    and the requested tool_use ids."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(oldest_sdk), os.getcwd()])}
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    (payload,) = out["raw_calls"]
    assert payload["response_id"] == out["raw_parsed_id"]
    assert payload["request_id"] == out["raw_request_id"]
    assert payload["stop_reason"] == "tool_use"
    assert payload["tool_use_ids"] == ["toolu_raw"]
    assert payload["usage"] == {
        "input_tokens": 10,
        "output_tokens": 7,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    assert payload["status"] == "ok"


def test_proxies_offer_the_sdk_objects_protocols_on_oldest_sdk(oldest_sdk: Path):
    """On anthropic 0.40 a sync stream or stream manager of the instrumentor is no async context
    manager and an async one no sync one, and a wrong with raises Python's TypeError."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(oldest_sdk), os.getcwd()])}
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["protocols"] == {
        "sync_manager_is_async": False,
        "sync_stream_is_async": False,
        "async_with_on_sync_manager": "TypeError",
        "async_manager_is_sync": False,
        "async_stream_is_sync": False,
    }


def test_stream_output_content_on_oldest_sdk(oldest_sdk: Path):
    """On anthropic 0.40 with content capture on, a stream read to the end records its content
    blocks as the Message's output, as a whole response does; a dropped or failed one records
    none."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(oldest_sdk), os.getcwd()]),
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true",
    }
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    calls = [e["payload"] for e in out["events"] if e["type"] == "model_call"]
    first, streamed, dropped, helper, _, mid_error, async_helper = calls

    def output(payload: dict[str, Any]) -> Any:
        return payload["content"].get("output_messages")

    assert output(first) == [
        {
            "role": "assistant",
            "content": [
                {"id": "toolu_old", "input": {"q": "x"}, "name": "lookup", "type": "tool_use"}
            ],
        }
    ]
    for payload, text in ((streamed, "a"), (helper, "c"), (async_helper, "e")):
        assert payload["status"] == "ok"
        assert output(payload) == [
            {"role": "assistant", "content": [{"type": "text", "text": text * 40}]}
        ]
    for payload in (dropped, mid_error):
        assert "input_messages" in payload["content"]
        assert "output_messages" not in payload["content"]
        assert "partial_output_messages" not in payload["content"]
