"""ingest.auth: bearer tokens from a file or the environment, and the runs they may write."""

from __future__ import annotations

import hmac

import pytest

from otel_agentcap.ingest.auth import ANONYMOUS, Authenticator, TokenConfigError

ADMIN = "admin-token-0123456789"
TEAM = "team-token-0123456789a"


def test_tokens_from_a_file_and_the_environment(tmp_path):
    """A token file with comments and scopes, and comma-separated tokens in the environment, are
    read; a token on several lines may write the union of their runs."""
    path = tmp_path / "tokens"
    path.write_text(f"# tokens\n\n{ADMIN}\n{TEAM}  team-a/*\n{TEAM}\trun 42 with spaces\n")
    auth = Authenticator.from_sources(path, env={"AGENTCAP_INGEST_TOKENS": "env-token-0123456789,"})
    admin = auth.authenticate(f"Bearer {ADMIN}")
    team = auth.authenticate(f"bearer {TEAM}")
    env = auth.authenticate("Bearer env-token-0123456789")
    assert admin is not None and admin.allows("anything")
    assert team is not None and team.allows("team-a/x") and team.allows("run 42 with spaces")
    assert not team.allows("team-b/x") and not team.allows("run 42")
    assert env is not None and env.allows("x")


@pytest.mark.parametrize("header", [None, "", "Bearer", f"Basic {ADMIN}", f"Bearer {ADMIN}x"])
def test_missing_or_wrong_tokens_are_refused(header):
    """No header, another scheme, or a token that is not configured gives no principal."""
    assert Authenticator([(ADMIN, None)]).authenticate(header) is None


def test_without_tokens_every_request_is_anonymous():
    """With no token configured every request is the anonymous principal, allowed every run."""
    assert Authenticator().authenticate(None) is ANONYMOUS


@pytest.mark.parametrize("entry", ["short", "has space-in-the-middle!!", "é" * 20])
def test_unusable_tokens_are_configuration_errors_that_do_not_echo_them(tmp_path, entry):
    """Short tokens and tokens outside the b64token alphabet are refused at start with the entry's
    position, never the token itself."""
    path = tmp_path / "tokens"
    path.write_text(f"{entry}\n")
    with pytest.raises(TokenConfigError) as info:
        Authenticator.from_sources(path, env={})
    assert "entry 1" in str(info.value) and entry.split()[0] not in str(info.value)


def test_every_token_is_compared_whatever_matches(monkeypatch):
    """The presented token is compared with every configured token (digests of equal length), so
    the time taken does not depend on which one, if any, matches."""
    tokens = [(f"token-{i:02d}-0123456789abc", None) for i in range(5)]
    auth = Authenticator(tokens)
    calls: list[int] = []
    original = hmac.compare_digest

    def counting(a, b):
        calls.append(len(a) + len(b))
        return original(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for header in (f"Bearer {tokens[0][0]}", f"Bearer {tokens[4][0]}", "Bearer nope"):
        calls.clear()
        auth.authenticate(header)
        assert calls == [64] * 5
