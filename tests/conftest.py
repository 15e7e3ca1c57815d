from collections.abc import Iterator

import pytest

from otel_agentcap.testing import forget_runs

pytest_plugins = ["otel_agentcap.testing.postgres"]


@pytest.fixture(autouse=True)
def _fresh_run_ids() -> Iterator[None]:
    """Tests reuse run ids: each test starts with no run id opened in this process."""
    forget_runs()
    yield
    forget_runs()
