"""The web view on large runs: time to first render of a run page and to highlight a causal past,
in headless chromium, for runs of 1,000, 10,000 and 100,000 events; and the HTML export's size.

Runs an embedded PostgreSQL in a temporary directory (deleted afterwards), stores synthetic runs
(``otel_agentcap.testing.synthetic``: 16 agents, model -> tool -> model chains, memory reads across
agents), serves them with ``otel-agentcap ui``'s server and opens each run page ``--rounds`` times
in a fresh page. Reported per size (medians):

- ``graph``: time of ``/api/run`` (the run's graph, no payloads) and its size;
- ``first render``: navigation start to the first drawn frame of the page (``performance.mark``);
- ``highlight``: selecting the last memory read of the run, i.e. computing its causal past and
  future and redrawing (measured in the page), and the same seen from Python (``select`` call);
- ``export``: bytes of ``export --format html`` per event.

Each figure is also given as a ratio to the smallest run, so how time grows with size reads
directly (10x and 100x the events).

    .venv/bin/python bench/bench_viewer.py [--sizes 1000,10000,100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

from otel_agentcap.exporters.postgres import embedded
from otel_agentcap.exporters.postgres.migrate import migrate
from otel_agentcap.testing.synthetic import synthetic_run, write_batches
from otel_agentcap.viewer.app import ViewerConfig
from otel_agentcap.viewer.export import export_html
from otel_agentcap.viewer.serve import ViewerServer

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _median(values: list[float]) -> float:
    return statistics.median(values)


def measure(dsn: str, sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    from playwright.sync_api import sync_playwright

    results = []
    with (
        ViewerServer(ViewerConfig(dsn=dsn)) as server,
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for size in sizes:
            run_id = f"bench-{size}"
            with psycopg.connect(dsn) as conn:
                row = conn.execute(
                    "SELECT agent_id, logical_seq FROM agentcap.events WHERE run_id = %s"
                    " AND event_type = 'memory_read' ORDER BY logical_seq DESC LIMIT 1",
                    (run_id,),
                ).fetchone()
            assert row is not None
            agent, seq = row
            graph_s, graph_bytes, render_ms, highlight_ms, select_s, past = [], 0, [], [], [], 0
            for _ in range(rounds):
                started = time.perf_counter()
                with urllib.request.urlopen(f"{server.url}/api/run?run={run_id}") as response:
                    graph_bytes = len(response.read())
                graph_s.append(time.perf_counter() - started)
                context = browser.new_context(viewport={"width": 1600, "height": 900})
                page = context.new_page()
                page.goto(f"{server.url}/runs/{run_id}")
                page.wait_for_selector("body[data-ready='1']", timeout=120_000)
                render_ms.append(
                    page.evaluate(
                        "() => performance.getEntriesByName('agentcap:first-render')[0].startTime"
                    )
                )
                started = time.perf_counter()
                page.evaluate("([a, s]) => agentcapView.select(a, s)", [agent, seq])
                select_s.append(time.perf_counter() - started)
                highlight_ms.append(page.evaluate("() => agentcapView.lastHighlightMs()"))
                past = len(page.evaluate("() => agentcapView.marks().past"))
                context.close()
            with psycopg.connect(dsn) as conn:
                exported = len(export_html(conn, run_id).encode())
            results.append(
                {
                    "events": size,
                    "graph_ms": _median(graph_s) * 1000,
                    "graph_bytes": graph_bytes,
                    "render_ms": _median(render_ms),
                    "highlight_ms": _median(highlight_ms),
                    "select_ms": _median(select_s) * 1000,
                    "past": past,
                    "export_bytes": exported,
                }
            )
        browser.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="agentcap-bench-viewer-"))
    try:
        dsn = embedded.start(root / "pg", database="postgres")
        migrate(dsn)
        for size in sizes:
            started = time.perf_counter()
            write_batches(dsn, synthetic_run(f"bench-{size}", size, agents=16))
            print(f"stored bench-{size} in {time.perf_counter() - started:.1f} s", flush=True)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
        results = measure(dsn, sizes, args.rounds)
    finally:
        embedded.destroy(root / "pg")
    base = results[0]
    print()
    print(
        f"{'events':>8} {'graph ms':>9} {'graph KB':>9} {'render ms':>10} {'highlight ms':>13}"
        f" {'select ms':>10} {'past':>7} {'export B/event':>15}"
    )
    for r in results:
        print(
            f"{r['events']:>8,} {r['graph_ms']:>9.1f} {r['graph_bytes'] / 1024:>9.0f}"
            f" {r['render_ms']:>10.1f} {r['highlight_ms']:>13.2f} {r['select_ms']:>10.1f}"
            f" {r['past']:>7,} {r['export_bytes'] / r['events']:>15.0f}"
        )
    print()
    print("growth against the smallest run (events ratio, then each time's ratio):")
    for r in results[1:]:
        print(
            f"  x{r['events'] / base['events']:.0f} events: graph x{r['graph_ms'] / base['graph_ms']:.1f},"
            f" first render x{r['render_ms'] / base['render_ms']:.1f},"
            f" highlight x{r['highlight_ms'] / max(base['highlight_ms'], 0.01):.1f},"
            f" select seen from Python x{r['select_ms'] / base['select_ms']:.1f}"
        )


if __name__ == "__main__":
    main()
