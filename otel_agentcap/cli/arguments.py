"""Argument types of the command line: a value out of range is a usage error naming the option,
before anything connects, binds or computes with it."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from urllib.parse import urlsplit


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An int within ``minimum`` .. ``maximum`` (inclusive)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f"at least {minimum}" if maximum is None else f"{minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {value}")
        return value

    return parse


def positive_number(text: str) -> float:
    """A finite number above zero (seconds, MiB)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text}")
    return value


def seconds_or_zero(text: str) -> float:
    """A finite number of seconds, 0 or more (0: no limit, where an option says so)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of 0 or more, not {text}")
    return value


def utf8(value: str) -> str:
    """Text that can be sent to PostgreSQL or written out: an argument holding bytes that are not
    UTF-8 (which Python keeps as lone surrogates) is a usage error rather than a traceback."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not valid UTF-8: {value!r}") from None
    return value


def web_address(text: str) -> str:
    """An http:// or https:// address with a host (the base of links the web view draws: any
    other scheme, javascript: say, would make those links run or open something else)."""
    parts = urlsplit(utf8(text))
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"not an http:// or https:// address: {text!r}")
    return text


port = integer(0, 65535)
