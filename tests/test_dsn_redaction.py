"""Passwords in DSNs never reach what is printed or logged."""

from __future__ import annotations

import pytest

from otel_agentcap.configure import configure
from otel_agentcap.errors import ConfigurationError
from otel_agentcap.exporters.postgres.connection import without_password


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://u:s3cret@h/db", "postgresql://u:***@h/db"),
        ('in URI: "postgres://u:s3cret@[bad/db"', 'in URI: "postgres://u:***@[bad/db"'),
        ("postgresql://:s3cret@h/db", "postgresql://:***@h/db"),
        ("host=h password=s3cret port=5", "host=h password=*** port=5"),
        ("host=h password='s3 cret' port=5", "host=h password=*** port=5"),
        ("user=u PASSWORD = s3cret", "user=u PASSWORD = ***"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("host=h user=u", "host=h user=u"),
    ],
)
def test_without_password(text, expected):
    assert without_password(text) == expected


def test_configure_names_a_bad_dsn_without_its_password(tmp_path):
    with pytest.raises(ConfigurationError) as raised:
        configure(
            "postgresql://u:s3cret@[bad/db",
            queue_dir=tmp_path,
            set_global=False,
            instrument=False,
            announce=False,
        )
    assert "s3cret" not in str(raised.value) and "u:***@" in str(raised.value)


@pytest.mark.parametrize(
    ("dsn", "older_libpq_accepts_it"),
    [
        ("postgresql://u:s3cret%zz@h/db", False),
        ("postgresql://u:s3cret pw@h/db", True),
        ("host=h user=u s3cret", False),
    ],
)
def test_configure_names_a_dsn_libpq_cannot_parse_without_its_password(
    tmp_path, caplog, dsn, older_libpq_accepts_it
):
    """libpq's error quotes only the token it cannot parse, which may be the password. (Older
    libpq releases, as psycopg-binary 3.2.1 ships, take a space in a URI's password: the host is
    then merely unreachable, and what is logged must not name the password either.)"""
    try:
        handle = configure(
            dsn,
            queue_dir=tmp_path,
            set_global=False,
            instrument=False,
            announce=False,
            shutdown_timeout=2.0,
        )
    except ConfigurationError as exc:
        assert "s3cret" not in str(exc) and "***" in str(exc)
        return
    # configure() installs process-wide registries whatever set_global says: restore them.
    handle.shutdown()
    assert older_libpq_accepts_it, f"configure() accepted {dsn!r}"
    assert "not reachable at start" in caplog.text
    assert "s3cret" not in caplog.text
