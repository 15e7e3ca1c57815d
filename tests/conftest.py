from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import settings

from otel_agentcap.testing import forget_runs

# Imported here before pytest loads it as a plugin: its asserts must still be rewritten.
pytest.register_assert_rewrite("anthropic_support")

from anthropic_support import ANTHROPIC_RELEASE  # noqa: E402

# anthropic_support (tests/anthropic_support.py): fixtures of the tests that run the anthropic SDK.
pytest_plugins = ["otel_agentcap.testing.postgres", "anthropic_support"]

# Test modules written for a newer anthropic than the package's floor (0.40): below the release
# named they are not collected, so .ci/floors runs the rest of the suite at the floor. In the
# development environment (the newest release) every module is collected.
_NEEDS_ANTHROPIC: dict[str, tuple[int, ...]] = {
    # the SDK's own tracing (from 1.17: its spans, the open_telemetry client option)
    "test_anthropic_causal.py": (1, 17),
    "test_anthropic_streams.py": (1, 17),
    "test_payload_docs.py": (1, 17),
    # raw streams' output with content on (the SDK's stream recorder, tested from 2.14)
    "test_anthropic_stream_content.py": (2, 14),
    # the SDK's tool runners, toolsets and Sessions runner (tested from 2.14)
    "test_anthropic_sessions.py": (2, 14),
    "test_anthropic_tool_runner.py": (2, 14),
    "test_anthropic_toolsets.py": (2, 14),
    "test_anthropic_instrumentor.py": (2, 14),
}
collect_ignore = [name for name, needed in _NEEDS_ANTHROPIC.items() if needed > ANTHROPIC_RELEASE]

# No property test has a deadline: hypothesis's default (200 ms an example) is a timed assertion,
# and with two test workers on two cores an example that takes 1 ms took 330 ms once (CI).
settings.register_profile("agentcap", deadline=None)
settings.load_profile("agentcap")

# The durable queue of everything configure() sets up in tests (and in the processes tests
# start, which inherit the environment) lives in a directory of this session, not in the
# user's state directory.
# Made (and removed at exit) only by the process that starts the session. Under pytest-xdist each
# worker has a directory of its own inside it: a process adopts the queues other processes left in
# its directory, which must not be another worker's.
if "AGENTCAP_QUEUE_DIR" not in os.environ:
    os.environ["AGENTCAP_QUEUE_DIR"] = tempfile.mkdtemp(prefix="agentcap-test-queue-")
    atexit.register(shutil.rmtree, os.environ["AGENTCAP_QUEUE_DIR"], ignore_errors=True)
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and not os.environ.get("AGENTCAP_TEST_QUEUE_WORKER"):
    os.environ["AGENTCAP_TEST_QUEUE_WORKER"] = _WORKER
    os.environ["AGENTCAP_QUEUE_DIR"] = os.path.join(os.environ["AGENTCAP_QUEUE_DIR"], _WORKER)
    os.makedirs(os.environ["AGENTCAP_QUEUE_DIR"], exist_ok=True)


@pytest.fixture(autouse=True)
def _fresh_run_ids() -> Iterator[None]:
    """Tests reuse run ids: each test starts with no run id opened in this process."""
    forget_runs()
    yield
    forget_runs()
