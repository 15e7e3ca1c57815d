"""The ``anthropic`` releases this instrumentation supports.

* ``anthropic >= 0.40, < 1.17`` (no tracing of its own): the instrumentor records one ``chat``
  span per ``messages.create`` (sync, async, ``stream=True``) and ``messages.stream(...)`` call.
* ``anthropic >= 1.17, < 3`` (traces itself, scope ``com.anthropic.sdk.python``): the
  instrumentor adds no span; it adds the causal links and the requested ``tool_use`` ids to the
  SDK's own spans.

Tested at both ends: 0.40.0 (``tests/test_anthropic_oldest_sdk.py``) and the release installed in
the development environment (2.x).
"""

from typing import Final

_instruments: Final = ("anthropic >= 0.40, < 3",)
_supports_metrics: Final = False

OLDEST_SUPPORTED: Final = "0.40.0"
