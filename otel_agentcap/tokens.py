"""Bearer tokens for the servers the command line starts on other addresses than loopback.

A token comes from a file (``--token-file``; its first line, surrounding blanks removed) or from
the environment variable ``AGENTCAP_TOKEN``, in that order. It is compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

ENV_TOKEN: Final = "AGENTCAP_TOKEN"

#: Shorter tokens are refused: a server reachable from a network needs one that is hard to guess.
MIN_TOKEN_LENGTH: Final = 16


class TokenError(ValueError):
    """No usable token where one is required, or a token file that cannot be read."""


def read_token(
    token_file: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The configured token, or ``None`` when neither the file nor the variable gives one."""
    if token_file is not None:
        try:
            text = Path(token_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenError(f"cannot read token file {os.fspath(token_file)!r}: {exc}") from None
        token = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not token:
            raise TokenError(f"token file {os.fspath(token_file)!r} is empty")
    else:
        token = (environ if environ is not None else os.environ).get(ENV_TOKEN, "").strip()
        if not token:
            return None
    if len(token) < MIN_TOKEN_LENGTH:
        raise TokenError(f"the token must be at least {MIN_TOKEN_LENGTH} characters long")
    return token


def is_loopback(host: str) -> bool:
    """Whether binding to ``host`` keeps a server reachable from this machine only."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def require_token(host: str, token: str | None) -> None:
    """Refuse to serve on a non-loopback address without a token."""
    if token is None and not is_loopback(host):
        raise TokenError(
            f"binding to {host} exposes the server beyond this machine: give a token with "
            f"--token-file or ${ENV_TOKEN}"
        )


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``token`` as a bearer token."""
    if not authorization:
        return False
    scheme, _, presented = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(presented.strip().encode(), token.encode())
