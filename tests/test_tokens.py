"""Bearer tokens for servers bound beyond loopback: sources, length, comparison."""

from __future__ import annotations

import pytest

from otel_agentcap.tokens import (
    ENV_TOKEN,
    TokenError,
    bearer_matches,
    is_loopback,
    read_token,
    require_token,
)

TOKEN = "0123456789abcdef-token"


def test_token_file_comes_before_the_environment(tmp_path):
    """The file's first line (blanks stripped) wins over the variable; neither gives None."""
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}  \nsecond line\n")
    assert read_token(path, {ENV_TOKEN: "other-token-0123456789"}) == TOKEN
    assert read_token(None, {ENV_TOKEN: f" {TOKEN}\n"}) == TOKEN
    assert read_token(None, {}) is None


def test_bad_tokens_are_refused(tmp_path):
    """A short, empty or unreadable token is a clear error, never an open server."""
    empty = tmp_path / "empty"
    empty.write_text("\n \n")
    with pytest.raises(TokenError, match="empty"):
        read_token(empty)
    with pytest.raises(TokenError, match="cannot read"):
        read_token(tmp_path / "missing")
    with pytest.raises(TokenError, match="at least 16"):
        read_token(None, {ENV_TOKEN: "short"})


def test_loopback_and_bearer_checks():
    """Loopback needs no token, anything else does; only 'Bearer <token>' matches."""
    for host in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        require_token(host, None)
    for host in ("0.0.0.0", "::", "192.0.2.1", "example.org"):
        assert not is_loopback(host)
        with pytest.raises(TokenError):
            require_token(host, None)
        require_token(host, TOKEN)
    assert bearer_matches(f"Bearer {TOKEN}", TOKEN)
    assert bearer_matches(f"bearer {TOKEN}", TOKEN)
    assert not bearer_matches(TOKEN, TOKEN)
    assert not bearer_matches(f"Basic {TOKEN}", TOKEN)
    assert not bearer_matches(f"Bearer {TOKEN}x", TOKEN)
    assert not bearer_matches(None, TOKEN)
