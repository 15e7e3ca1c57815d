"""The ``otel-agentcap`` command: run the demo, list runs, show a run, manage the embedded server."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import psycopg

from otel_agentcap.cli import arguments
from otel_agentcap.cli.timeline import (
    Totals,
    event_positions,
    layout,
    parent_text,
    summary,
    totals,
)
from otel_agentcap.errors import RunExistsError
from otel_agentcap.exporters.postgres import embedded, partitions, retention, store
from otel_agentcap.exporters.postgres.connection import first_line, without_password
from otel_agentcap.exporters.postgres.database import ENV_DSN, resolve_dsn
from otel_agentcap.exporters.postgres.errors import (
    AgentCapStorageError,
    EventNotFound,
    LockWaitTimeout,
    RunNotFound,
    SchemaNotReady,
)
from otel_agentcap.exporters.postgres.migrate import migrate
from otel_agentcap.tokens import (
    INGEST_TOKENS_ENV,
    UI_TOKENS_ENV,
    Authenticator,
    TokenConfigError,
)

if TYPE_CHECKING:
    from otel_agentcap.serving import TlsConfig


class CliError(Exception):
    """An error the user can cause and fix: printed as one line, exit status 1."""


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _print_json(data: Any) -> None:
    json.dump(data, sys.stdout, default=_json_default, ensure_ascii=False, indent=2)
    sys.stdout.write("\n")


def _console() -> Any:
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # Newer rich releases exit with status 1 here; main() ends every command alike.
            self.quiet = True
            raise BrokenPipeError

    # Plain text (no colour, no boxes drawn with control codes) when not writing to a terminal,
    # and tables as wide as they need (rich would fold them into 80 columns).
    width = None if sys.stdout.isatty() else 1000
    # Never markup: whatever is printed from the database or from arguments goes through _text.
    return _Console(highlight=False, soft_wrap=True, width=width, markup=False, emoji=False)


#: Characters a terminal would act on rather than show: C0 and C1 controls (ESC starts escape
#: sequences), and the bidirectional overrides that reorder what is shown.
_CONTROL_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


#: Those and line breaks and tabs, for a value printed within one line (an id, a name, a summary):
#: it cannot start a line of its own that would read as another entry of a listing.
_LINE_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _shown(value: object, pattern: re.Pattern[str] = _CONTROL_RE) -> str:
    """``value`` as text a terminal shows as is: control characters as ``\\xNN`` escapes."""
    return pattern.sub(lambda m: ascii(m.group())[1:-1], str(value))


def _text(*parts: object | tuple[object, str]) -> Any:
    """A rich ``Text`` of ``parts`` (a value, or a (value, style) pair) on one line, never read as
    markup."""
    from rich.text import Text

    text = Text()
    for part in parts:
        if isinstance(part, tuple):
            text.append(_shown(part[0], _LINE_CONTROL_RE), style=part[1])
        else:
            text.append(_shown(part, _LINE_CONTROL_RE))
    return text


def _dsn(args: argparse.Namespace) -> str:
    dsn = resolve_dsn(args.dsn, announce=False)
    try:
        dsn.encode("utf-8")
    except UnicodeEncodeError:
        # --dsn or AGENTCAP_DSN holding bytes that are not UTF-8 (lone surrogates to Python).
        raise CliError("invalid DSN: not valid UTF-8") from None
    return dsn


def _connect(dsn: str, *, lock_timeout: float | None = None) -> psycopg.Connection[Any]:
    """A connection to ``dsn``; with ``lock_timeout`` its queries give up after waiting that many
    seconds for a lock another session holds (see ``store.limit_lock_waits``)."""
    try:
        conn = psycopg.connect(dsn, connect_timeout=5)
    except psycopg.ProgrammingError as exc:
        raise CliError(f"invalid DSN: {first_line(exc, dsn)}") from None
    except psycopg.OperationalError as exc:
        raise CliError(f"cannot connect to PostgreSQL: {first_line(exc, dsn)}") from None
    if lock_timeout is not None:
        try:
            store.limit_lock_waits(conn, lock_timeout)
        except BaseException:
            conn.close()
            raise
    return conn


def _reader(args: argparse.Namespace) -> psycopg.Connection[Any]:
    """The connection of a read command: it waits at most ``--lock-timeout`` seconds for a lock."""
    return _connect(_dsn(args), lock_timeout=args.lock_timeout)


def cmd_demo(args: argparse.Namespace) -> int:
    from otel_agentcap.configure import configure
    from otel_agentcap.demo import run_demo

    dsn = _dsn(args)
    with _connect(dsn) as conn:
        migrate(conn)
    agentcap = configure(dsn, announce=False)
    started = time.monotonic()
    console = _console()
    # A spinner on a terminal; nothing on a pipe or with --json.
    status = (
        console.status("running the demo agents and writing the event log")
        if console.is_terminal and not args.json
        else contextlib.nullcontext()
    )
    with status:
        try:
            result = run_demo(args.run_id, live=args.live)
        except RunExistsError as exc:
            agentcap.shutdown()
            raise CliError(f"{exc} (or leave out --run-id)") from None
        agentcap.force_flush()
    elapsed = time.monotonic() - started
    stats = agentcap.stats()
    with _connect(dsn) as conn:
        runs = {r.run_id: r for r in store.list_runs(conn, limit=1000)}
        conflicts = store.conflicts_count(conn, result.run_id)
        by_type = Counter(e.event_type for e in store.run_events(conn, result.run_id))
    agentcap.shutdown()
    stored = runs.get(result.run_id)
    data = {
        "run_id": result.run_id,
        "dsn": dsn,
        "seconds": round(elapsed, 3),
        "agents": stored.agents if stored else 0,
        "events": stored.events if stored else 0,
        "conflicts": conflicts,
        "timed_out_agents": result.timed_out_agents,
        "failed_tools": result.failed_tools,
        "events_by_type": dict(sorted(by_type.items())),
        "export": asdict(stats),
    }
    if args.json:
        _print_json(data)
        return 0
    console = _console()
    console.print(
        _text(
            f"run {result.run_id}: {data['agents']} agents, {data['events']} events stored in "
            f"{elapsed:.2f} s"
        )
    )
    console.print(
        _text(
            f"  {by_type['model_call']} model calls, {by_type['tool_invocation']} tool calls "
            f"({result.failed_tools} failed), {by_type['memory_write']} memory writes, timed out: "
            f"{', '.join(result.timed_out_agents) or 'none'}, conflicts: {conflicts}"
        )
    )
    console.print(_text(f"  database: {without_password(dsn)}"))
    dsn_flag = f" --dsn {shlex.quote(without_password(args.dsn))}" if args.dsn else ""
    # As the user ran it (e.g. .venv/bin/otel-agentcap from make demo), so it can be pasted.
    prog = sys.argv[0] if sys.argv[0].endswith("otel-agentcap") else "otel-agentcap"
    console.print(_text(f"next: {prog} show {shlex.quote(result.run_id)}{dsn_flag}"))
    console.print(
        _text(
            f"      {prog} export {shlex.quote(result.run_id)}{dsn_flag} --format jaeger-json"
            f" -o {shlex.quote(result.run_id + '.json')}   (open it in the Jaeger UI: Search, Upload)"
        )
    )
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    with _reader(args) as conn:
        runs = store.list_runs(conn, limit=args.limit)
    if args.json:
        _print_json([asdict(r) for r in runs])
        return 0
    from rich.table import Table

    table = Table("run", "started", "agents", "events", "duration", box=None)
    for run in runs:
        duration = ""
        if run.first_wall_time and run.last_wall_time:
            duration = f"{(run.last_wall_time - run.first_wall_time).total_seconds():.2f} s"
        started = run.started_at.isoformat(timespec="seconds") if run.started_at else ""
        table.add_row(
            _text(run.run_id), _text(started), _text(run.agents), _text(run.events), _text(duration)
        )
    console = _console()
    if not runs:
        console.print(_text("no runs stored yet; try: otel-agentcap demo"))
        return 0
    console.print(table)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _reader(args) as conn:
        try:
            events = store.run_events(conn, args.run_id)
            agents = store.run_agents(conn, args.run_id)
        except RunNotFound:
            raise CliError(
                f"unknown run id: {_shown(repr(args.run_id))} (see: otel-agentcap runs)"
            ) from None
        known = {e.event_id for e in events}
        missing = sorted({p for e in events for p in e.causal_parent_ids if p not in known})
        elsewhere = store.locate_events(conn, args.run_id, missing)
        conflicts = store.conflicts_by_agent(conn, args.run_id)
    positions = event_positions(events, elsewhere)
    run_totals, agent_totals = totals(events, conflicts)
    if args.json:
        _print_json(
            {
                "run_id": args.run_id,
                "agents": [asdict(a) for a in agents],
                "events": [
                    _event_json(e, positions)
                    for e in sorted(events, key=lambda e: (e.agent_id, e.seq))
                ],
                "totals": {
                    "run": asdict(run_totals),
                    "agents": {agent: asdict(t) for agent, t in agent_totals.items()},
                },
            }
        )
        return 0
    console = _console()
    for line in layout(events, agents):
        indent = "  " * line.depth
        if line.event is None:
            record = line.agent
            name = f" ({record.name})" if record.name and record.name != record.agent_id else ""
            console.print(_text(indent, (f"agent {record.agent_id}", "bold"), name))
            continue
        event = line.event
        parents = parent_text(event, positions)
        console.print(
            _text(
                f"{indent}{event.seq:>6}  {event.event_type:<16} ",
                summary(event),
                f"  {parents}" if parents else "",
            )
        )
        if args.payloads or args.content:
            for text in _payload_lines(event.payload, content=args.content):
                console.print(_text(f"{indent}{'':>8}", text))
    console.print()
    console.print(_totals_table(run_totals, agent_totals))
    return 0


#: Bytes of the input ``import`` reads to tell its format: an agentcap-pb header fits.
_IMPORT_PREFIX = 64 * 1024


def _import_source(args: argparse.Namespace, stack: contextlib.ExitStack) -> tuple[Any, bytes]:
    """The input of ``import`` (a seekable file: standard input is copied to a temporary file
    when it is agentcap-pb) and, when it is not agentcap-pb, its bytes, read whole."""
    from otel_agentcap.transfer import agentcap_pb

    try:
        if args.file == "-":
            source: Any = sys.stdin.buffer
        else:
            source = stack.enter_context(open(args.file, "rb"))  # noqa: SIM115 (the stack closes it)
        prefix = source.read(_IMPORT_PREFIX)
        if prefix.lstrip()[:1] != b"{" and agentcap_pb.is_agentcap_pb(prefix):
            if args.file != "-" and source.seekable():
                source.seek(0)
                return source, b""
            spool = stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115 (as above)
            spool.write(prefix)
            shutil.copyfileobj(source, spool, 1 << 20)
            spool.seek(0)
            return spool, b""
        return None, prefix + source.read()
    except OSError as exc:
        raise CliError(f"cannot read {args.file}: {exc.strerror or exc}") from None
    except MemoryError:  # /dev/zero, say: the input is read whole
        raise CliError(f"cannot read {args.file}: out of memory") from None


def cmd_import(args: argparse.Namespace) -> int:
    from otel_agentcap.exporters.postgres.database import Database
    from otel_agentcap.transfer.load import import_file, import_stream

    with contextlib.ExitStack() as stack:
        source, data = _import_source(args, stack)
        dsn = _dsn(args)
        # A bad DSN is a one-line error here; so is a lock held longer than --lock-timeout.
        with _connect(dsn, lock_timeout=args.lock_timeout) as conn:
            migrate(conn)
        database = Database(dsn, name="import", lock_timeout=args.lock_timeout)
        try:
            if source is not None:
                # agentcap-pb: read a message at a time (twice: checked, then written).
                try:
                    result = import_stream(database, source)
                except OSError as exc:
                    raise CliError(f"cannot read {args.file}: {exc.strerror or exc}") from None
            else:
                result = import_file(database, data)
        except ValueError as exc:
            raise CliError(f"cannot import {args.file}: {exc}") from None
        finally:
            database.close()
    # Records left out are a failure of the import (status 1), though the rest is stored.
    status = 1 if result.rejected else 0
    if args.json:
        _print_json(asdict(result))
        return status
    extra = [
        f"{count} {what}"
        for count, what in (
            (result.rejected, "left out (invalid: see the warning above)"),
            (result.record_conflicts, "agent or run records differing from the stored ones"),
            (result.expired, "of runs past the log's retention"),
            (
                result.unparsed_attributes,
                'run attributes not a JSON object (stored as {"$agentcap.unparsed": text})',
            ),
            (
                result.unparsed_payloads,
                'payloads not JSON (stored as {"$agentcap.unparsed": text} markers)',
            ),
        )
        if count
    ]
    print(
        f"imported {result.format} into {len(result.runs)} run(s) "
        f"({_shown(', '.join(result.runs), _LINE_CONTROL_RE) or 'none'}): "
        f"{result.events_inserted} events stored, "
        f"{result.duplicates} already there, {result.conflicts} conflicting"
        + (f", {result.conflicts_imported} conflict rows" if result.format == "agentcap-pb" else "")
        + "".join(f", {text}" for text in extra)
    )
    return status


def _event_json(event: Any, positions: dict[str, tuple[str, int]]) -> dict[str, Any]:
    data: dict[str, Any] = event._asdict()
    parents = []
    for parent in event.causal_parent_ids:
        agent_id, seq = positions.get(parent, (None, None))
        parents.append({"event_id": parent, "agent_id": agent_id, "seq": seq})
    data["causal_parents"] = parents
    return data


def _payload_lines(payload: Any, *, content: bool) -> list[str]:
    """An event's payload as indented JSON lines; a model call's ``content`` only if asked."""
    if isinstance(payload, dict) and not content and "content" in payload:
        payload = {k: v for k, v in payload.items() if k != "content"}
        payload["content"] = "(recorded; --content shows it)"
    text = json.dumps(payload, default=_json_default, ensure_ascii=False, indent=2)
    return text.splitlines()


def _totals_table(run: Totals, agents: dict[str, Totals]) -> Any:
    from rich.table import Table

    table = Table(
        "totals",
        "model calls",
        "tokens in",
        "out",
        "cache read",
        "cache write",
        "model latency",
        "tool calls",
        "tool failed",
        "errors",
        "conflicts",
        box=None,
    )

    def row(name: Any, t: Totals) -> None:
        calls = f"{t.model_calls}" + (
            f" ({t.model_call_errors} failed)" if t.model_call_errors else ""
        )
        table.add_row(
            name,
            calls,
            str(t.input_tokens),
            str(t.output_tokens),
            str(t.cache_read_input_tokens),
            str(t.cache_creation_input_tokens),
            f"{t.model_latency_ms / 1000:.2f} s",
            str(t.tool_calls),
            str(t.tool_failures),
            str(t.agent_errors),
            str(t.conflicts),
        )

    for agent_id, agent_totals in agents.items():
        row(_text(agent_id), agent_totals)
    row(_text(("run", "bold")), run)
    return table


def _event_line(event: Any, indent: str = "  ") -> Any:
    # Text, never markup (the console reads none): ids and summaries come from the database.
    return _text(
        f"{indent}",
        event.agent_id,
        f" {event.seq:>6}  {event.event_type:<16} ",
        summary(event),
        "  ",
        (event.event_id, "dim"),
    )


def cmd_event(args: argparse.Namespace) -> int:
    with _reader(args) as conn:
        try:
            found = store.event(conn, args.run_id, args.event_id)
            parents = store.event_parents(conn, args.run_id, args.event_id)
            children = store.event_children(conn, args.run_id, args.event_id)
            past = store.causal_past(conn, args.run_id, args.event_id) if args.past else None
        except RunNotFound:
            raise CliError(f"unknown run id: {args.run_id!r} (see: otel-agentcap runs)") from None
        except EventNotFound:
            raise CliError(
                f"no event {args.event_id!r} in run {args.run_id!r} (see: otel-agentcap show)"
            ) from None
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if args.json:
        data: dict[str, Any] = {
            "event": found._asdict(),
            "parents": [e._asdict() for e in parents],
            "children": [e._asdict() for e in children],
        }
        if past is not None:
            data["past"] = [e._asdict() for e in past]
        _print_json(data)
        return 0
    console = _console()
    console.print(_event_line(found, ""))
    sections = [("parents", parents), ("children", children)]
    if past is not None:
        sections.append(("causal past", past))
    for title, events in sections:
        console.print(f"{title}: {len(events)}")
        for item in events:
            console.print(_event_line(item))
    return 0


def _parse_time(text: str) -> datetime:
    """An ISO date or time; a date means its midnight, and no zone means UTC."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"not an ISO date or time: {text!r} (e.g. 2025-06-01)") from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def _utc_minutes(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M")


def _db_partitions(args: argparse.Namespace) -> int:
    with _connect(_dsn(args), lock_timeout=args.lock_timeout) as conn:
        migrate(conn)
        conn.autocommit = True
        if args.interval is not None:
            try:
                partitions.set_partition_interval(conn, args.interval)
            except ValueError as exc:
                raise CliError(str(exc)) from None
        created = partitions.ensure_ahead(conn, args.ahead) if args.ahead is not None else 0
        settings = partitions.read_settings(conn)
        ranges = partitions.summarize(conn)
    if args.json:
        _print_json(
            {
                "partition_interval": str(settings.partition_interval),
                "pruned_before": settings.pruned_before,
                "created": created,
                "partitions": [asdict(r) for r in ranges],
            }
        )
        return 0
    from rich.table import Table

    console = _console()
    pruned = _utc_minutes(settings.pruned_before) if settings.pruned_before else "never"
    console.print(
        f"partition interval: {settings.partition_interval}; pruned before: {pruned}; "
        f"created now: {created}"
    )
    table = Table("runs started from (UTC)", "until", "events (estimate)", "size", box=None)
    for r in ranges:
        state = " (detach pending)" if r.detach_pending else ""
        table.add_row(
            _utc_minutes(r.lower),
            _utc_minutes(r.upper) + state,
            f"{r.events_estimate:,}" if r.events_estimate >= 0 else "not analyzed",
            f"{r.total_bytes / 1e6:,.1f} MB",
        )
    console.print(table)
    return 0


def _db_prune(args: argparse.Namespace) -> int:
    if args.before is None:
        raise CliError("db prune needs --before DATE (runs that started before it are removed)")
    before = _parse_time(args.before)
    with _connect(_dsn(args), lock_timeout=args.lock_timeout) as conn:
        migrate(conn)
        conn.autocommit = True
        try:
            result = retention.prune(conn, before, dry_run=args.dry_run)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if args.json:
        _print_json(asdict(result))
        return 0
    console = _console()
    if result.pruned_before is None:
        console.print(f"nothing to prune: no partition ends at or before {_utc_minutes(before)}")
        return 0
    verb = "would remove" if result.dry_run else "removed"
    console.print(
        f"{verb} {result.runs} run(s) started before {_utc_minutes(result.pruned_before)} "
        f"and {len(result.partitions)} partition(s)"
    )
    for part in result.partitions:
        took = "" if result.dry_run else f"  {part.seconds:.3f} s"
        console.print(
            f"  {part.partition}  [{_utc_minutes(part.lower)}, {_utc_minutes(part.upper)}){took}"
        )
    if result.pruned_before < before:
        console.print(
            f"runs started from {_utc_minutes(result.pruned_before)} on are kept whole: their "
            f"partition ends after {_utc_minutes(before)}"
        )
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    action = args.action
    if action == "start":
        dsn = embedded.start()
        with _connect(dsn) as conn:
            migrate(conn)
        print(dsn)
        return 0
    if action == "stop":
        stopped = embedded.stop()
        print("stopped" if stopped else "not running")
        return 0
    if action == "status":
        status = embedded.status()
        if args.json:
            _print_json(asdict(status))
        else:
            print(f"running: {status.running}  data: {status.data_dir}  dsn: {status.dsn or '-'}")
        return 0
    if action == "dsn":
        print(_dsn(args))
        return 0
    if action == "migrate":
        with _connect(_dsn(args), lock_timeout=args.lock_timeout) as conn:
            applied = migrate(conn)
        print(f"applied migrations: {applied}" if applied else "schema is up to date")
        return 0
    if action == "grant":
        return _grant(args)
    if action == "partitions":
        return _db_partitions(args)
    if action == "prune":
        return _db_prune(args)
    raise CliError(f"unknown db action {action!r}")


def _grant(args: argparse.Namespace) -> int:
    from otel_agentcap.exporters.postgres.roles import Roles, grant

    reader = None if args.reader.lower() == "none" else args.reader
    roles = Roles(owner=args.owner, writer=args.writer, reader=reader)
    try:
        with _connect(_dsn(args), lock_timeout=args.lock_timeout) as conn:
            migrate(conn)
            created = grant(conn, roles)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        _print_json(
            {"owner": roles.owner, "writer": roles.writer, "reader": reader, "created": created}
        )
        return 0
    for name in created:
        print(f"created role {_shown(name)} (NOLOGIN)")
    print(f"owner:  {_shown(roles.owner)} (owns the agentcap schema; run migrations as it)")
    print(
        f"writer: {_shown(roles.writer)} (exporter and ingest: SELECT, INSERT; no UPDATE, "
        "DELETE or TRUNCATE of events and conflicts)"
    )
    if reader is not None:
        print(f"reader: {_shown(reader)} (SELECT only)")
    print(
        "give them to login roles, e.g.: GRANT "
        f"{_shown(roles.writer)} TO my_app; GRANT {_shown(roles.owner)} TO my_admin"
    )
    return 0


def _tokens(args: argparse.Namespace, variable: str) -> Authenticator:
    """The bearer tokens of a server command: ``--token-file`` and the command's variable."""
    try:
        return Authenticator.from_sources(args.token_file, variable=variable)
    except TokenConfigError as exc:
        raise CliError(str(exc)) from None


def _tls(args: argparse.Namespace) -> TlsConfig | None:
    """The TLS settings of a server command, or None to serve plain HTTP."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise CliError("give both --tls-cert and --tls-key")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise CliError("--tls-client-ca needs --tls-cert and --tls-key")
    if args.tls_cert is None:
        return None
    from otel_agentcap.serving import TlsConfig

    return TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca)


def _missing_dependency(command: str, exc: ImportError) -> CliError:
    return CliError(
        f"{command} is missing a dependency of the default install; reinstall otel-agentcap ({exc})"
    )


def cmd_ingest(args: argparse.Namespace) -> int:
    try:
        from otel_agentcap.ingest import IngestLimits, OtlpIngestServer, serve
    except ImportError as exc:
        raise _missing_dependency("the ingest", exc) from None
    authenticator = _tokens(args, INGEST_TOKENS_ENV)
    tls = _tls(args)
    try:
        limits = IngestLimits(
            max_body_bytes=int(args.max_body_mib * 1024 * 1024),
            max_concurrent_requests=args.max_concurrent,
            max_spans=args.max_spans,
            idle_timeout=args.idle_timeout,
            lock_timeout=args.lock_timeout,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    dsn = _dsn(args)
    # A bad DSN is a one-line error here, before serving; so is a lock held too long.
    with _connect(dsn, lock_timeout=args.lock_timeout) as conn:
        migrate(conn)

    def announce(server: OtlpIngestServer) -> None:
        print(f"accepting OTLP/HTTP traces at {server.endpoint} (Ctrl-C stops)", file=sys.stderr)
        if server.grpc_endpoint is not None:
            print(f"accepting OTLP/gRPC traces at {server.grpc_endpoint}", file=sys.stderr)
        for warning in server.warnings():
            print(f"otel-agentcap: warning: {warning}", file=sys.stderr)

    try:
        stats = serve(
            dsn,
            args.host,
            args.port,
            on_ready=announce,
            grpc_port=args.grpc_port,
            authenticator=authenticator,
            tls=tls,
            limits=limits,
        )
    except OSError as exc:
        raise CliError(f"cannot listen on {args.host}: {exc}") from None
    if args.json:
        _print_json(asdict(stats))
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    try:
        from otel_agentcap.viewer.app import ViewerConfig
        from otel_agentcap.viewer.serve import ViewerServer
    except ImportError as exc:
        raise _missing_dependency("the web view", exc) from None

    authenticator = _tokens(args, UI_TOKENS_ENV)
    tls = _tls(args)
    dsn = _dsn(args)
    # A bad DSN is a one-line error here, before serving; so is a lock held too long.
    with _connect(dsn, lock_timeout=args.lock_timeout) as conn:
        migrate(conn)
    config = ViewerConfig(
        dsn=dsn,
        authenticator=authenticator,
        jaeger_url=args.jaeger_url,
        tls=tls,
        lock_timeout=args.lock_timeout,
    )
    try:
        server = ViewerServer(config, args.host, args.port)
    except TokenConfigError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None

    def announce(ready: ViewerServer) -> None:
        print(f"serving the event log at {ready.url}/ (read-only; Ctrl-C stops)", file=sys.stderr)
        for warning in ready.warnings():
            print(f"otel-agentcap: warning: {warning}", file=sys.stderr)

    server.serve(on_ready=announce)
    return 0


def _export_html(args: argparse.Namespace, conn: psycopg.Connection[Any]) -> bytes:
    from otel_agentcap.viewer.export import export_html

    return export_html(conn, args.run_id, jaeger_url=args.jaeger_url).encode()


def _log_format(name: str) -> Callable[[argparse.Namespace, psycopg.Connection[Any]], bytes]:
    """The writer of a format of ``otel_agentcap.transfer.formats`` (agentcap-pb, otlp-json,
    jaeger-json: the run's rows or its rebuilt trace)."""

    def write(args: argparse.Namespace, conn: psycopg.Connection[Any]) -> bytes:
        from otel_agentcap.transfer.formats import export_run

        return export_run(conn, args.run_id, name)

    return write


#: ``otel-agentcap export --format NAME``: each writer returns the bytes of one run's export.
EXPORT_FORMATS: dict[str, Callable[[argparse.Namespace, psycopg.Connection[Any]], bytes]] = {
    "html": _export_html,
    "agentcap-pb": _log_format("agentcap-pb"),
    "otlp-json": _log_format("otlp-json"),
    "jaeger-json": _log_format("jaeger-json"),
}
#: Formats whose output is binary: not written to a terminal.
BINARY_FORMATS: frozenset[str] = frozenset({"agentcap-pb"})
#: Formats written to the output as the run is read (``transfer.formats``), not built whole.
_STREAMED_FORMATS: frozenset[str] = frozenset({"agentcap-pb", "otlp-json", "jaeger-json"})


class _Stdout(io.RawIOBase):
    """Standard output as a file ``export`` writes to, left open when closed."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return sys.stdout.buffer.write(data)

    def close(self) -> None:
        sys.stdout.flush()


def _export_streamed(args: argparse.Namespace, conn: psycopg.Connection[Any]) -> int:
    """Write a run in a format of ``otel_agentcap.transfer.formats`` to ``--output`` as it is
    read (batch by batch for agentcap-pb); returns the bytes written (see :func:`_write_output`)."""
    from otel_agentcap.transfer.formats import export_run_to

    return _write_output(
        args.output, lambda open_output: export_run_to(conn, args.run_id, args.format, open_output)
    )


def _write_whole(output: str, data: bytes) -> int:
    """Write ``data`` to ``output`` (see :func:`_write_output`)."""

    def write(open_output: Callable[[], BinaryIO]) -> int:
        with open_output() as out:
            out.write(data)
        return len(data)

    return _write_output(output, write)


def _write_output(output: str, write: Callable[[Callable[[], BinaryIO]], int]) -> int:
    """``write(open_output)`` to ``output`` (``-``: standard output); returns what it returns.

    A file is written under a temporary name beside it and renamed over ``--output`` once
    complete, so a failure part-way leaves no part-written file and an existing file as it was.
    An output that is not a regular file (a FIFO, a device), or a directory where no temporary
    file can be made, is written in place (a regular file begun then is removed on failure)."""
    if output == "-":
        return write(lambda: cast(BinaryIO, _Stdout()))
    target = Path(output)
    in_place = target.exists() and not target.is_file()
    part: str | None = None
    opened = False

    def open_output() -> BinaryIO:
        nonlocal part, opened
        if not in_place:
            try:
                fd, part = tempfile.mkstemp(
                    dir=target.parent, prefix=f".{target.name}.", suffix=".part"
                )
            except OSError:
                part = None
            else:
                os.chmod(part, _new_file_mode(target))
                return os.fdopen(fd, "wb")
        out = open(target, "wb")  # noqa: SIM115 (closed by export_run_to)
        opened = True
        return out

    try:
        size = write(open_output)
        if part is not None:
            os.replace(part, target)
        return size
    except OSError as exc:
        _remove_part_written(part, output, opened)
        raise CliError(f"cannot write {output}: {exc.strerror or exc}") from None
    except BaseException:
        _remove_part_written(part, output, opened)
        raise


def _new_file_mode(target: Path) -> int:
    """The permissions ``open(target, "w")`` would leave: the existing file's, else 0o666 less
    the umask."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _remove_part_written(part: str | None, path: str, opened: bool) -> None:
    with contextlib.suppress(OSError):
        if part is not None:
            os.unlink(part)
        elif opened and os.path.isfile(path):
            os.unlink(path)


def cmd_export(args: argparse.Namespace) -> int:
    writer = EXPORT_FORMATS[args.format]
    if args.output == "-" and args.format in BINARY_FORMATS and sys.stdout.isatty():
        raise CliError(f"{args.format} is binary: write it to a file with -o FILE, or redirect")
    data: bytes | None = None
    with _reader(args) as conn:
        try:
            if args.format in _STREAMED_FORMATS:
                size = _export_streamed(args, conn)
            else:
                data = writer(args, conn)
        except RunNotFound:
            raise CliError(
                f"unknown run id: {_shown(repr(args.run_id))} (see: otel-agentcap runs)"
            ) from None
    if data is not None:
        size = _write_whole(args.output, data)
    if args.output != "-":
        print(f"wrote {args.output} ({size:,} bytes)", file=sys.stderr)
    return 0


def _server_security_options(parser: argparse.ArgumentParser, use: str, variable: str) -> None:
    parser.add_argument(
        "--token-file",
        help="bearer tokens, one a line, each optionally followed by the run ids (or a prefix "
        f"ending in *) it may {use}; also ${variable} (same form, comma-separated)",
    )
    parser.add_argument("--tls-cert", help="serve TLS with this certificate chain (PEM)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    parser.add_argument(
        "--tls-client-ca", help="require client certificates signed by this CA (PEM)"
    )


def _queue_directory(args: argparse.Namespace) -> Any:
    from otel_agentcap.exporters.durable.directory import (
        QueueDirectory,
        default_base_dir,
        target_of,
    )

    base = Path(args.queue_dir) if args.queue_dir else default_base_dir()
    if base.exists() and not base.is_dir():
        raise CliError(f"the queue directory {base} is not a directory")
    dsn = _dsn(args)
    try:
        # The queue's directory is named after the database: a DSN libpq cannot read names
        # none (and would be shown whole, password included).
        psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise CliError(f"invalid DSN: {first_line(exc, dsn)}") from None
    return dsn, QueueDirectory(base, target_of(dsn))


def cmd_queue(args: argparse.Namespace) -> int:
    from otel_agentcap.exporters.durable.inspect import queue_report

    dsn, directory = _queue_directory(args)
    if args.action == "status":
        report = queue_report(directory)
        if args.json:
            _print_json(report)
            return 0
        print(f"queue directory: {report['path']}  (database {report['target']})")
        for queue in report["queues"]:
            state = "its process runs" if queue["locked"] else "left by an ended process"
            print(
                f"  {queue['name']}: {queue['bytes']:,} bytes in {queue['segments']} segment(s), "
                f"{state}"
            )
        if not report["queues"]:
            print("  no queues")
        if report["rejected_files"]:
            print(
                f"  rejected: {report['rejected_files']} file(s) of records the database refused "
                f"in {report['rejected']}"
            )
        return 0
    if not directory.path.is_dir():
        # Nothing was ever queued there for this database; draining must not create it.
        if args.json:
            empty = ("spans_read", "events_inserted", "duplicates", "conflicts")
            _print_json({"drained": True, **dict.fromkeys(empty, 0)})
        else:
            print(f"nothing to drain: no queue for this database in {directory.path}")
        return 0
    from otel_agentcap.exporters.durable.processor import DurableSpanProcessor
    from otel_agentcap.exporters.postgres import Database, PostgresSpanExporter

    with _connect(dsn) as conn:  # a bad DSN or a server that is down: one line, exit 1
        migrate(conn)
    database = Database(dsn)
    exporter = PostgresSpanExporter(database=database, owns_database=True)
    processor = DurableSpanProcessor(exporter, directory)
    drained = processor.drain(args.timeout)
    adopted = processor.stats()["spans_adopted"]
    processor.close(1.0)
    stats = exporter.stats()
    data = {
        "drained": drained,
        "spans_read": adopted,
        "events_inserted": stats.events_inserted,
        "duplicates": stats.duplicates,
        "conflicts": stats.conflicts,
    }
    if args.json:
        _print_json(data)
    else:
        print(
            f"{'delivered' if drained else 'not all delivered within the timeout:'} "
            f"{adopted:,} spans read, {stats.events_inserted:,} events stored, "
            f"{stats.duplicates:,} already stored, {stats.conflicts:,} conflicts"
        )
    return 0 if drained else 1


def _lock_timeout_option(
    parser: argparse.ArgumentParser,
    default: float = store.READ_LOCK_TIMEOUT,
    outcome: str = "give up",
) -> None:
    parser.add_argument(
        "--lock-timeout",
        type=arguments.seconds_or_zero,
        default=default,
        metavar="SECONDS",
        help=f"{outcome} after waiting this long for a lock another session holds on the log "
        f"(a migration, other DDL, a LOCK TABLE); 0: no limit (default: {default:g})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otel-agentcap",
        description="Causal event log of multi-agent LLM programs, in PostgreSQL.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dsn", help=f"PostgreSQL DSN (default: ${ENV_DSN}, else the embedded server)"
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", parents=[common], help="run the demo multi-agent program")
    demo.add_argument(
        "--run-id", type=arguments.utf8, help="run id to record under (default: generated)"
    )
    demo.add_argument(
        "--live", action="store_true", help="call the real Anthropic API (needs ANTHROPIC_API_KEY)"
    )
    demo.set_defaults(func=cmd_demo)

    runs = sub.add_parser("runs", parents=[common], help="list recorded runs")
    runs.add_argument("--limit", type=arguments.integer(1), default=50)
    _lock_timeout_option(runs)
    runs.set_defaults(func=cmd_runs)

    show = sub.add_parser(
        "show",
        parents=[common],
        help="show a run in causal order, with causal parents and totals",
    )
    show.add_argument("run_id", type=arguments.utf8)
    show.add_argument("--payloads", action="store_true", help="print each event's payload")
    show.add_argument(
        "--content",
        action="store_true",
        help="also print model-call message content (recorded only when content capture was on)",
    )
    _lock_timeout_option(show)
    show.set_defaults(func=cmd_show)

    load = sub.add_parser(
        "import",
        parents=[common],
        help="load an agentcap-pb or OTLP (JSON or protobuf) file into the log, deduplicated",
    )
    load.add_argument("file", help="the file, or - for standard input")
    _lock_timeout_option(load)
    load.set_defaults(func=cmd_import)

    ingest = sub.add_parser(
        "ingest", parents=[common], help="receive OTLP traces from a collector into the log"
    )
    ingest.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ingest.add_argument(
        "--port", type=arguments.port, default=4319, help="OTLP/HTTP port (0: any free)"
    )
    ingest.add_argument(
        "--grpc-port", type=arguments.port, default=None, help="also serve OTLP/gRPC on this port"
    )
    _server_security_options(ingest, "write", INGEST_TOKENS_ENV)
    ingest.add_argument(
        "--max-body-mib",
        type=arguments.positive_number,
        default=64,
        help="largest request, after decompression",
    )
    ingest.add_argument(
        "--max-spans",
        type=arguments.integer(1),
        default=100_000,
        help="most spans in one request (more: 413, or RESOURCE_EXHAUSTED on gRPC)",
    )
    ingest.add_argument(
        "--max-concurrent",
        type=arguments.integer(1),
        default=4,
        help="requests read and stored at once",
    )
    ingest.add_argument(
        "--idle-timeout",
        type=arguments.positive_number,
        default=30,
        help="seconds before an idle connection closes",
    )
    _lock_timeout_option(
        ingest,
        store.INGEST_LOCK_TIMEOUT,
        "answer a request 'retry later' (503, gRPC UNAVAILABLE)",
    )
    ingest.set_defaults(func=cmd_ingest)

    ui = sub.add_parser("ui", parents=[common], help="serve a read-only web view of the event log")
    ui.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    ui.add_argument("--port", type=arguments.port, default=8321, help="port (0: any free port)")
    _server_security_options(ui, "read", UI_TOKENS_ENV)
    ui.add_argument(
        "--jaeger-url",
        type=arguments.web_address,
        help="base address of a Jaeger UI, to link events to their spans",
    )
    _lock_timeout_option(ui)
    ui.set_defaults(func=cmd_ui)

    export = sub.add_parser(
        "export",
        parents=[common],
        help="write one run to a file",
        description="Formats: html, the web view in one file; agentcap-pb, the log's rows "
        "(proto/agentcap/eventlog/v1), which import reads back; otlp-json, the run's trace as "
        "OTLP/JSON, which import reads back; jaeger-json, the run's trace as Jaeger's "
        "/api/traces JSON (the Jaeger UI opens it from a file).",
    )
    export.add_argument("run_id", type=arguments.utf8)
    export.add_argument("--format", required=True, choices=sorted(EXPORT_FORMATS))
    export.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    export.add_argument(
        "--jaeger-url",
        type=arguments.web_address,
        help="html: base address of a Jaeger UI, to link events to their spans",
    )
    _lock_timeout_option(export)
    export.set_defaults(func=cmd_export)

    queue = sub.add_parser(
        "queue", parents=[common], help="the durable queue: what waits, and delivering it"
    )
    queue.add_argument("action", choices=["status", "drain"])
    queue.add_argument(
        "--queue-dir", help="queue directory (default: $AGENTCAP_QUEUE_DIR, else the user's)"
    )
    queue.add_argument(
        "--timeout", type=arguments.positive_number, default=300.0, help="drain: seconds at most"
    )
    queue.set_defaults(func=cmd_queue)

    event = sub.add_parser(
        "event", parents=[common], help="an event with its causal parents and children"
    )
    event.add_argument("run_id", type=arguments.utf8)
    event.add_argument("event_id", type=arguments.utf8)
    event.add_argument(
        "--past", action="store_true", help="also every event that happened before it"
    )
    _lock_timeout_option(event)
    event.set_defaults(func=cmd_event)

    db = sub.add_parser(
        "db",
        parents=[common],
        help="the embedded server, migrations, roles, partitions, retention",
    )
    db.add_argument(
        "action",
        choices=["start", "stop", "status", "dsn", "migrate", "grant", "partitions", "prune"],
    )
    db.add_argument(
        "--owner",
        default="agentcap_owner",
        type=arguments.utf8,
        help="grant: the role that owns the schema",
    )
    db.add_argument(
        "--writer",
        default="agentcap_writer",
        type=arguments.utf8,
        help="grant: the append-only writer role",
    )
    db.add_argument(
        "--reader",
        default="agentcap_reader",
        type=arguments.utf8,
        help="grant: the read-only role ('none': no reader)",
    )
    db.add_argument(
        "--before",
        metavar="DATE",
        type=arguments.utf8,
        help="prune: remove the runs that started before DATE (UTC)",
    )
    db.add_argument("--dry-run", action="store_true", help="prune: only say what would go")
    _lock_timeout_option(db)
    db.add_argument(
        "--ahead",
        type=arguments.integer(0),
        metavar="N",
        help="partitions: create the partitions of this and the next N intervals",
    )
    db.add_argument(
        "--interval",
        metavar="WIDTH",
        help="partitions: width of partitions created from now on ('1 month', '7 days', ...)",
    )
    db.set_defaults(func=cmd_db)
    return parser


def _stdout_closed() -> int:
    """The reader of our output went away (``| head``): stop quietly, as ``cat`` would. Standard
    output goes to /dev/null so that the interpreter's final flush does not fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE: the status a shell reports for `cat big | head`


_NO_SCHEMA = (
    "the database has no agentcap schema (or not all of it): run `otel-agentcap db migrate` "
    "with the same --dsn first"
)


def _gave_up_on_a_lock(args: argparse.Namespace) -> int:
    """The one line of a command that waited ``--lock-timeout`` seconds for a lock."""
    waited = getattr(args, "lock_timeout", None)
    after = f" after {waited:g} s" if waited else ""
    longer = ", or wait longer with --lock-timeout" if waited else ""
    print(
        f"otel-agentcap: gave up{after} waiting for a lock another session holds on the "
        f"event log (a migration or other DDL?); try again later{longer}",
        file=sys.stderr,
    )
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        status = func(args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except CliError as exc:
        print(f"otel-agentcap: {_shown(exc)}", file=sys.stderr)
        return 1
    except (LockWaitTimeout, psycopg.errors.LockNotAvailable):
        return _gave_up_on_a_lock(args)
    except (SchemaNotReady, psycopg.errors.UndefinedTable) as exc:
        if isinstance(exc, SchemaNotReady) or "agentcap." in str(exc):
            print(f"otel-agentcap: {_NO_SCHEMA}", file=sys.stderr)
        else:
            print(f"otel-agentcap: database error: {_shown(first_line(exc))}", file=sys.stderr)
        return 1
    except AgentCapStorageError as exc:
        if isinstance(exc.__cause__, psycopg.errors.LockNotAvailable):  # migrate() wraps it
            return _gave_up_on_a_lock(args)
        print(f"otel-agentcap: {_shown(first_line(exc))}", file=sys.stderr)
        return 1
    except psycopg.Error as exc:
        print(f"otel-agentcap: database error: {_shown(first_line(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
