"""A captured workload for the durable queue's fault tests (run as a separate process).

    python durable_worker.py DSN RUN_ID NAME --ops N [--rate R] [--counter FILE]
        [--shutdown-timeout S] [--queue-dir DIR] [--fsize-limit BYTES] [--latencies]

Under agent ``shared`` of run RUN_ID it does N operations: a memory write, a memory read of what
it wrote (a causal parent), a tool call (two events), in turn. After each operation returns it
writes the operations and events captured so far into the 16-byte counter file (shared memory:
it survives a SIGKILL of this process), so a test knows exactly what was handed over. At the end
it shuts down with the given timeout and prints one JSON line: ops, events (agent_start and
agent_end included), the handle's stats, how long shutdown took, and with ``--latencies`` the
slowest operations in seconds (entering the agent counts as one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import resource
import signal
import struct
import sys
import time

import otel_agentcap as ac
from otel_agentcap.configure import configure

parser = argparse.ArgumentParser()
parser.add_argument("dsn")
parser.add_argument("run_id")
parser.add_argument("name")
parser.add_argument("--ops", type=int, default=1000)
parser.add_argument("--rate", type=float, default=0.0)
parser.add_argument("--counter")
parser.add_argument("--shutdown-timeout", type=float, default=30.0)
parser.add_argument("--queue-dir")
parser.add_argument("--fsize-limit", type=int, default=0)
parser.add_argument("--latencies", action="store_true")
args = parser.parse_args()

if args.fsize_limit:
    # A disk that fills up: writes past the limit fail with EFBIG (SIGXFSZ ignored).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))

counter = None
if args.counter:
    fd = os.open(args.counter, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 16)
    counter = mmap.mmap(fd, 16)

agentcap = configure(
    args.dsn,
    queue_dir=args.queue_dir,
    shutdown_timeout=args.shutdown_timeout,
    announce=False,
)
memory = ac.Memory("m")


@ac.tool
def tool(x: int) -> int:
    return x + 1


ops = 0
events = 0
slowest: list[tuple[float, str]] = []
started = time.monotonic()
entering = time.perf_counter()
# resume: several processes (and a restarted one) serve the same run.
with ac.run(args.run_id, resume=True), ac.agent("shared"):
    if args.latencies:
        slowest.append((time.perf_counter() - entering, "enter"))  # an operation too
    events += 1  # agent_start
    for i in range(args.ops):
        if args.rate:
            due = started + i / args.rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        t0 = time.perf_counter()
        kind = i % 3
        if kind == 0:
            memory[f"{args.name}-k{i % 10}"] = {"op": i, "note": "x" * 200}
            events += 1
        elif kind == 1:
            memory.get(f"{args.name}-k{(i - 1) % 10}")
            events += 1
        else:
            tool.invoke(f"{args.name}-{i}", i)
            events += 2
        ops += 1
        if args.latencies:
            slowest.append((time.perf_counter() - t0, f"{('write', 'read', 'tool')[kind]} {i}"))
        if counter is not None:
            counter[0:16] = struct.pack("<QQ", ops, events)
events += 1  # agent_end
shutdown_started = time.monotonic()
agentcap.shutdown(args.shutdown_timeout)
shutdown_s = time.monotonic() - shutdown_started
out = {
    "ops": ops,
    "events": events,
    "stats": dataclasses.asdict(agentcap.stats()),
    "shutdown_s": shutdown_s,
    "elapsed_s": time.monotonic() - started,
}
if args.latencies:
    out["slowest"] = [s for s, _ in sorted(slowest)[-5:]]
    out["slowest_ops"] = [f"{name}: {s:.3f} s" for s, name in sorted(slowest)[-5:]]
    out["over_250ms"] = sum(1 for s, _ in slowest if s > 0.25)
    out["over_1s"] = sum(1 for s, _ in slowest if s > 1.0)
print(json.dumps(out), flush=True)
sys.exit(0)
