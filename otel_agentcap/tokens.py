"""Bearer tokens of the servers the command line starts, and the runs each token may use.

``otel-agentcap ingest`` and ``otel-agentcap ui`` read their tokens the same way: from a file
(``--token-file``) and from an environment variable named after the command,
``AGENTCAP_INGEST_TOKENS`` or ``AGENTCAP_UI_TOKENS`` (both sources together, when both are set).
Separate variables keep the tokens that write to the log apart from those that read it, even in one
environment. The file holds one token a line, optionally followed by the runs it may use; blank
lines and lines starting with ``#`` are skipped::

    # token                        runs it may use (none: every run)
    Zm9vYmFyYmF6cXV4cXV1eDEyMzQ1
    dGVhbS1hLXRva2VuLTEyMzQ1Njc4   team-a/*
    b25lLXJ1bi10b2tlbi0xMjM0NTY3   run-42

The scope is the rest of the line: a run id, or a prefix ending in ``*``. The ingest stores spans of
those runs only; the web view lists and shows those runs only (any other answers as an unknown
run). A token on several lines may use the union of their scopes. The environment variable holds
entries separated by newlines or commas, in the same form (a run id that contains a comma needs the
file).

A token is 16 to 512 characters of the RFC 6750 ``b64token`` alphabet. The presented token is
hashed (SHA-256) and compared with the hash of every configured token with
``hmac.compare_digest``, so the time taken says nothing about how much of a token was right. The
web view's login cookie holds :func:`session_value` of the token (an HMAC keyed by it), never the
token, and is checked the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

#: Tokens of ``otel-agentcap ingest`` (they write to the log).
INGEST_TOKENS_ENV: Final = "AGENTCAP_INGEST_TOKENS"
#: Tokens of ``otel-agentcap ui`` (they read the log).
UI_TOKENS_ENV: Final = "AGENTCAP_UI_TOKENS"

_TOKEN_RE: Final = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
MIN_TOKEN_LENGTH: Final = 16
MAX_TOKEN_LENGTH: Final = 512
_SESSION_LABEL: Final = b"otel-agentcap ui session"


class TokenConfigError(ValueError):
    """A token file or variable that cannot be used, or a server that needs a token and has none
    (the message says which entry, never the token)."""


@dataclass(frozen=True, slots=True)
class RunScope:
    """The runs a token may use: exact ids and id prefixes."""

    exact: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()

    def allows(self, run_id: str) -> bool:
        return run_id in self.exact or run_id.startswith(self.prefixes)

    def describe(self) -> str:
        parts = sorted(self.exact) + [f"{p}*" for p in self.prefixes]
        return ", ".join(repr(p) for p in parts)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent a request: which configured token (by position), and the runs it may use
    (``scope`` None: every run)."""

    name: str
    scope: RunScope | None = None

    def allows(self, run_id: str) -> bool:
        return self.scope is None or self.scope.allows(run_id)


#: The principal of every request when no token is configured.
ANONYMOUS: Final = Principal("anonymous")


def session_value(token: str) -> str:
    """What a login cookie holds for ``token``: derived from it, never the token itself."""
    return hmac.new(token.encode("utf-8", "surrogateescape"), _SESSION_LABEL, "sha256").hexdigest()


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True, slots=True)
class _Grant:
    digest: bytes
    session_digest: bytes
    principal: Principal


def _entries(lines: Iterable[str], source: str) -> list[tuple[str, str | None]]:
    entries = []
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        token, scope = parts[0], (parts[1].strip() if len(parts) > 1 else "")
        where = f"{source}, entry {number}"
        if not _TOKEN_RE.match(token):
            raise TokenConfigError(f"{where}: a token must be RFC 6750 b64token characters")
        if not MIN_TOKEN_LENGTH <= len(token) <= MAX_TOKEN_LENGTH:
            raise TokenConfigError(
                f"{where}: a token must be {MIN_TOKEN_LENGTH} to {MAX_TOKEN_LENGTH} characters"
            )
        entries.append((token, scope or None))
    return entries


class Authenticator:
    """Checks the bearer token (or login cookie) of a request; without tokens every request is
    anonymous, allowed every run."""

    def __init__(self, entries: Iterable[tuple[str, str | None]] = ()) -> None:
        scopes: dict[str, tuple[set[str], list[str], bool, int]] = {}
        for token, scope in entries:
            exact, prefixes, everything, index = scopes.setdefault(
                token, (set(), [], False, len(scopes) + 1)
            )
            if scope is None:
                everything = True
            elif scope.endswith("*"):
                prefixes.append(scope[:-1])
            else:
                exact.add(scope)
            scopes[token] = (exact, prefixes, everything, index)
        self._grants = tuple(
            _Grant(
                _digest(token),
                _digest(session_value(token)),
                Principal(
                    f"token #{index}",
                    None if everything else RunScope(frozenset(exact), tuple(prefixes)),
                ),
            )
            for token, (exact, prefixes, everything, index) in scopes.items()
        )

    @classmethod
    def from_sources(
        cls,
        token_file: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        *,
        variable: str = INGEST_TOKENS_ENV,
    ) -> Authenticator:
        """Tokens from ``token_file`` and from the variable ``variable`` of ``env`` (default:
        ``os.environ``); raises ``TokenConfigError`` for an unusable entry or an empty file."""
        entries: list[tuple[str, str | None]] = []
        if token_file is not None:
            path = Path(token_file)
            try:
                text = path.read_text("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenConfigError(f"cannot read token file {path}: {exc}") from exc
            entries += _entries(text.splitlines(), f"token file {path}")
            if not entries:
                raise TokenConfigError(f"token file {path} holds no token")
        value = (os.environ if env is None else env).get(variable, "")
        if value.strip():
            entries += _entries(re.split(r"[\n,]", value), variable)
        return cls(entries)

    @property
    def enabled(self) -> bool:
        return bool(self._grants)

    @property
    def scoped(self) -> bool:
        """Whether some token may use only some runs."""
        return any(grant.principal.scope is not None for grant in self._grants)

    def _match(self, digest: bytes, session: bool) -> Principal | None:
        match: Principal | None = None
        for grant in self._grants:  # every grant is compared: no early exit
            expected = grant.session_digest if session else grant.digest
            if hmac.compare_digest(digest, expected) and match is None:
                match = grant.principal
        return match

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal of a request whose ``Authorization`` header (or gRPC metadata) is
        ``authorization``; None when tokens are configured and it holds none of them."""
        if not self._grants:
            return ANONYMOUS
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return self._match(b"\0" * 32, session=False)
        return self.check_token(token)

    def check_token(self, token: str) -> Principal | None:
        """The principal of a token given as it is (a login form); None when tokens are
        configured and it is none of them."""
        if not self._grants:
            return ANONYMOUS
        return self._match(_digest(token.strip()), session=False)

    def check_session(self, value: str) -> Principal | None:
        """The principal whose :func:`session_value` is ``value`` (a login cookie); None when
        tokens are configured and it matches none of them."""
        if not self._grants:
            return ANONYMOUS
        return self._match(_digest(value), session=True)
