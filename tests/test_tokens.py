"""Bearer tokens of the ingest and the web view: sources, format, scopes, comparison, sessions."""

from __future__ import annotations

import hmac

import pytest
from hypothesis import given
from hypothesis import strategies as st

from otel_agentcap.tokens import (
    ANONYMOUS,
    INGEST_TOKENS_ENV,
    UI_TOKENS_ENV,
    Authenticator,
    TokenConfigError,
    session_value,
)

ADMIN = "admin-token-0123456789"
TEAM = "team-token-0123456789a"


def test_tokens_from_a_file_and_the_environment(tmp_path):
    """A token file with comments and scopes, and comma-separated tokens in the environment, are
    read together; a token on several lines may use the union of their runs."""
    path = tmp_path / "tokens"
    path.write_text(f"# tokens\n\n{ADMIN}\n{TEAM}  team-a/*\n{TEAM}\trun 42 with spaces\n")
    auth = Authenticator.from_sources(path, env={INGEST_TOKENS_ENV: "env-token-0123456789,"})
    admin = auth.authenticate(f"Bearer {ADMIN}")
    team = auth.authenticate(f"bearer {TEAM}")
    env = auth.authenticate("Bearer env-token-0123456789")
    assert admin is not None and admin.allows("anything")
    assert team is not None and team.allows("team-a/x") and team.allows("run 42 with spaces")
    assert not team.allows("team-b/x") and not team.allows("run 42")
    assert env is not None and env.allows("x")
    assert auth.scoped


def test_each_command_reads_its_own_variable():
    """The ingest reads AGENTCAP_INGEST_TOKENS and the web view AGENTCAP_UI_TOKENS, in the same
    form, so a token that writes is not one that reads unless both are given it."""
    env = {INGEST_TOKENS_ENV: f"{ADMIN}", UI_TOKENS_ENV: f"{TEAM} team-a/*\n"}
    ingest = Authenticator.from_sources(None, env)
    ui = Authenticator.from_sources(None, env, variable=UI_TOKENS_ENV)
    assert ingest.authenticate(f"Bearer {ADMIN}") is not None
    assert ingest.authenticate(f"Bearer {TEAM}") is None
    viewer = ui.authenticate(f"Bearer {TEAM}")
    assert viewer is not None and viewer.allows("team-a/1") and not viewer.allows("team-b/1")
    assert ui.authenticate(f"Bearer {ADMIN}") is None
    assert not Authenticator.from_sources(None, {}, variable=UI_TOKENS_ENV).enabled


@pytest.mark.parametrize("header", [None, "", "Bearer", f"Basic {ADMIN}", f"Bearer {ADMIN}x"])
def test_missing_or_wrong_tokens_are_refused(header):
    """No header, another scheme, or a token that is not configured gives no principal."""
    assert Authenticator([(ADMIN, None)]).authenticate(header) is None


def test_without_tokens_every_request_is_anonymous():
    """With no token configured every request is the anonymous principal, allowed every run."""
    auth = Authenticator()
    assert auth.authenticate(None) is ANONYMOUS
    assert auth.check_token("") is ANONYMOUS and auth.check_session("") is ANONYMOUS
    assert not auth.enabled and not auth.scoped


@pytest.mark.parametrize("entry", ["short", "has space-in-the-middle!!", "é" * 20, "x" * 513])
def test_unusable_tokens_are_configuration_errors_that_do_not_echo_them(tmp_path, entry):
    """Short and long tokens and tokens outside the b64token alphabet are refused at start with
    the entry's position, never the token itself; the variable's entries likewise."""
    path = tmp_path / "tokens"
    path.write_text(f"# first\n{entry}\n")
    with pytest.raises(TokenConfigError) as info:
        Authenticator.from_sources(path, env={})
    assert "entry 2" in str(info.value) and entry.split()[0] not in str(info.value)
    with pytest.raises(TokenConfigError) as info:
        Authenticator.from_sources(
            None, {UI_TOKENS_ENV: f"{ADMIN},{entry}"}, variable=UI_TOKENS_ENV
        )
    assert f"{UI_TOKENS_ENV}, entry 2" in str(info.value)
    assert entry.split()[0] not in str(info.value)


def test_an_empty_or_unreadable_token_file_is_an_error(tmp_path):
    """A token file without a token, or one that cannot be read, is refused: it never leaves a
    server open."""
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(TokenConfigError, match="holds no token"):
        Authenticator.from_sources(empty, env={})
    with pytest.raises(TokenConfigError, match="cannot read"):
        Authenticator.from_sources(tmp_path / "missing", env={})


def test_every_token_is_compared_whatever_matches(monkeypatch):
    """The presented token (or session value) is compared with every configured one (digests of
    equal length), so the time taken does not depend on which one, if any, matches."""
    tokens = [(f"token-{i:02d}-0123456789abc", None) for i in range(5)]
    auth = Authenticator(tokens)
    calls: list[int] = []
    original = hmac.compare_digest

    def counting(a, b):
        calls.append(len(a) + len(b))
        return original(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for check in (
        lambda: auth.authenticate(f"Bearer {tokens[0][0]}"),
        lambda: auth.authenticate(f"Bearer {tokens[4][0]}"),
        lambda: auth.authenticate("Bearer nope"),
        lambda: auth.authenticate(f"Basic {tokens[0][0]}"),
        lambda: auth.check_session(session_value(tokens[2][0])),
        lambda: auth.check_session("nope"),
    ):
        calls.clear()
        check()
        assert calls == [64] * 5


token_text = st.text(
    alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/",
    min_size=16,
    max_size=64,
)


@given(st.lists(token_text, min_size=1, max_size=4, unique=True), st.data())
def test_a_session_value_stands_for_its_token_only(tokens, data):
    """The login cookie's value identifies the token it was derived from, with that token's
    runs; it is never the token, and neither a token nor another value passes as a session."""
    auth = Authenticator((token, f"run-{i}") for i, token in enumerate(tokens))
    i = data.draw(st.integers(0, len(tokens) - 1))
    value = session_value(tokens[i])
    assert tokens[i] not in value
    principal = auth.check_session(value)
    assert principal is not None and principal == auth.check_token(tokens[i])
    assert principal.allows(f"run-{i}") and not principal.allows(f"run-{len(tokens)}")
    assert auth.check_session(tokens[i]) is None
    assert auth.check_token(value) is None
    assert auth.check_session(value[:-1]) is None


def test_the_readme_example_is_a_token_file_that_reads_as_it_says():
    """The token file the README shows is read as the README describes it."""
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Bearer tokens of the ingest and the web view", 1)[1]
    example = section.split("```\n", 2)[1]
    admin, team = (line.split()[0] for line in example.splitlines()[1:3])
    auth = Authenticator.from_sources(None, {UI_TOKENS_ENV: example}, variable=UI_TOKENS_ENV)
    everything = auth.authenticate(f"Bearer {admin}")
    scoped = auth.authenticate(f"Bearer {team}")
    assert everything is not None and everything.allows("any-run")
    assert scoped is not None and scoped.allows("team-a/7") and scoped.allows("nightly-42")
    assert not scoped.allows("team-b/7") and not scoped.allows("nightly-43")
