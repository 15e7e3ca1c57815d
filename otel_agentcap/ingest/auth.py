"""Bearer tokens of the OTLP ingest, and the runs each token may write.

Tokens come from a file (``--token-file``) or the environment (``AGENTCAP_INGEST_TOKENS``). The
file holds one token a line, optionally followed by the run ids it may write; blank lines and
lines starting with ``#`` are skipped::

    # token                        runs it may write (none: every run)
    Zm9vYmFyYmF6cXV4cXV1eDEyMzQ1
    dGVhbS1hLXRva2VuLTEyMzQ1Njc4   team-a/*
    b25lLXJ1bi10b2tlbi0xMjM0NTY3   run-42

The scope is the rest of the line: a run id, or a prefix ending in ``*``. A token on several
lines may write the union of their scopes. The environment variable holds entries separated by
newlines or commas, in the same form (a run id that contains a comma needs the file).

A token is 16 to 512 characters of the RFC 6750 ``b64token`` alphabet. The presented token is
hashed (SHA-256) and compared with the hash of every configured token with
``hmac.compare_digest``, so the time taken says nothing about how much of a token was right.
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

ENV_TOKENS: Final = "AGENTCAP_INGEST_TOKENS"

_TOKEN_RE: Final = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
MIN_TOKEN_LENGTH: Final = 16
MAX_TOKEN_LENGTH: Final = 512


class TokenConfigError(ValueError):
    """A token file or variable that cannot be used (say which line, never the token)."""


@dataclass(frozen=True, slots=True)
class RunScope:
    """The runs a token may write: ``None`` for every run, else exact ids and id prefixes."""

    exact: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()

    def allows(self, run_id: str) -> bool:
        return run_id in self.exact or run_id.startswith(self.prefixes)

    def describe(self) -> str:
        parts = sorted(self.exact) + [f"{p}*" for p in self.prefixes]
        return ", ".join(repr(p) for p in parts)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent a request: which configured token (by position), and the runs it may write
    (``scope`` None: every run)."""

    name: str
    scope: RunScope | None = None

    def allows(self, run_id: str) -> bool:
        return self.scope is None or self.scope.allows(run_id)


#: The principal of every request when no token is configured.
ANONYMOUS: Final = Principal("anonymous")


@dataclass(frozen=True, slots=True)
class _Grant:
    digest: bytes
    scope: RunScope | None
    name: str


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def _entries(lines: Iterable[str], source: str) -> list[tuple[str, str | None, str]]:
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
        entries.append((token, scope or None, where))
    return entries


class Authenticator:
    """Checks the bearer token of a request; without tokens every request is anonymous."""

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
                None if everything else RunScope(frozenset(exact), tuple(prefixes)),
                f"token #{index}",
            )
            for token, (exact, prefixes, everything, index) in scopes.items()
        )

    @classmethod
    def from_sources(
        cls, token_file: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
    ) -> Authenticator:
        """Tokens from ``token_file`` and from ``AGENTCAP_INGEST_TOKENS`` in ``env`` (default:
        ``os.environ``); raises ``TokenConfigError`` for an unusable entry."""
        entries: list[tuple[str, str | None, str]] = []
        if token_file is not None:
            path = Path(token_file)
            try:
                text = path.read_text("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenConfigError(f"cannot read token file {path}: {exc}") from exc
            entries += _entries(text.splitlines(), str(path))
            if not entries:
                raise TokenConfigError(f"token file {path} holds no token")
        value = (os.environ if env is None else env).get(ENV_TOKENS, "")
        if value.strip():
            entries += _entries(re.split(r"[\n,]", value), ENV_TOKENS)
        return cls((token, scope) for token, scope, _ in entries)

    @property
    def enabled(self) -> bool:
        return bool(self._grants)

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal of a request whose ``Authorization`` header (or gRPC metadata) is
        ``authorization``; None when tokens are configured and it holds none of them."""
        if not self._grants:
            return ANONYMOUS
        scheme, _, token = (authorization or "").strip().partition(" ")
        presented = _digest(token.strip()) if scheme.lower() == "bearer" else b"\0" * 32
        match: _Grant | None = None
        for grant in self._grants:  # every grant is compared: no early exit
            if hmac.compare_digest(presented, grant.digest) and match is None:
                match = grant
        if match is None:
            return None
        return Principal(match.name, match.scope)
