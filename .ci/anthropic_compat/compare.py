"""Compare two JUnit XML reports of the same tests: print every test that passed in the first
(without the instrumentation) and did not pass in the second (with it), and exit 1 if there is any.
With a report directory (what agentcap_sdk_plugin wrote), also print the events captured, and exit
1 if no tool run was captured (the instrumentation was not active).

A test in INTENDED asserts something of the SDK's own spans that the instrumentation changes on
purpose; it is listed with its reason, not counted as a regression, and must still pass without
the instrumentation.

    python compare.py without.xml with.xml [report-dir]
"""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

#: Test id (the SDK's) -> why it fails with the instrumentation.
INTENDED: dict[str, str] = {
    f"tests.test_open_telemetry.TestCallSpans::{name}": (
        "asserts that the span of a with_streaming_response call read by parse() has no response "
        "attributes; the instrumentation records the response once its body is read (usage, "
        "response id, tool_use ids), as the SDK records a with_raw_response body "
        "(otel_agentcap/instrumentation/anthropic/streamed_responses.py)"
    )
    for name in (
        "test_raw_response_ends_the_span_with_its_body",
        "test_async_raw_response_ends_the_span_with_its_body",
    )
}


def outcomes(path: str) -> dict[str, str]:
    """Test id -> passed | failed | error | skipped."""
    found: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                break
        # A test that errors in teardown after passing has two records: the worst one counts.
        if found.get(test_id, "passed") == "passed":
            found[test_id] = outcome
    return found


def main() -> int:
    without, with_ = outcomes(sys.argv[1]), outcomes(sys.argv[2])
    passed = sorted(t for t, o in without.items() if o == "passed")
    broken = [t for t in passed if with_.get(t) != "passed" and t not in INTENDED]
    intended = [t for t in passed if with_.get(t) != "passed" and t in INTENDED]
    counts = {o: sum(1 for v in without.values() if v == o) for o in sorted(set(without.values()))}
    print(f"without the instrumentation: {len(without)} tests {counts}")
    print(
        f"with it: {len(passed) - len(broken) - len(intended)} of those {len(passed)} passed "
        f"tests pass again, {len(intended)} differ on purpose"
    )
    for test_id in intended:
        print(f"  INTENDED {with_.get(test_id, 'missing')}: {test_id}: {INTENDED[test_id]}")
    for test_id in broken:
        print(f"  REGRESSION {with_.get(test_id, 'missing')}: {test_id}")
    status = 1 if broken else 0
    if len(sys.argv) > 3:
        captured: collections.Counter[str] = collections.Counter()
        for report in Path(sys.argv[3]).glob("*.json"):
            captured.update(json.loads(report.read_text()))
        print(f"events captured with it: {dict(sorted(captured.items()))}")
        if not captured["tool_invocation"]:
            print("  NO TOOL RUN WAS CAPTURED: the instrumentation was not active")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
