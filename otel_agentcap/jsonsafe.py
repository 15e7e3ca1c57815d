"""A documented, lossless-where-possible encoding of arbitrary Python values into JSON that
PostgreSQL's ``jsonb`` accepts.

JSON (and jsonb) cannot hold everything a tool may return. Values that JSON cannot hold as given are
wrapped in a one-key object whose key starts with ``$agentcap.``:

================================  ===============================================================
value                              stored as
================================  ===============================================================
``bytes`` / ``bytearray``          ``{"$agentcap.bytes": "<base64>"}``
``float`` NaN / +-Infinity         ``{"$agentcap.float": "NaN" | "Infinity" | "-Infinity"}``
``str`` with NUL or a lone         ``{"$agentcap.str": "<base64 of UTF-8, surrogatepass>"}``
surrogate (jsonb rejects both)
``int`` of more than 14,000 bits   ``{"$agentcap.int": "0x<hex>"}`` (``str()`` refuses such ints)
a dict with a key JSON cannot      ``{"$agentcap.items": [[key, value], ...]}`` (keys converted as
hold (NUL or lone surrogate in a   values)
str key, a key whose ``str()``
fails)
anything else not JSON             ``{"$agentcap.repr": "<repr, at most 2000 chars>", "type": "mod.Class"}``
(also a container inside itself,   (a cycle reads ``[...]`` or ``{...}``)
and values past 300,000 in one
payload)
a payload over the size limit      ``{"$agentcap.truncated": "<first N chars of the JSON>", "size": n}``
================================  ===============================================================

A value that cannot be converted becomes a ``$agentcap.repr`` marker in place; the rest of the
payload is kept. Dict keys that are not strings are converted with ``str()``; tuples and sets become lists;
dataclasses and objects with ``model_dump()`` (pydantic, the anthropic SDK's types) are dumped first.
A dict that itself has a ``$agentcap.*`` key is wrapped as ``{"$agentcap.literal": {...}}``
so user data never reads as one of our markers (some of which have a second key).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import enum
import json
import math
import re
import reprlib
import uuid
from collections.abc import Mapping
from typing import Any, Final, Literal

MARKER_PREFIX: Final = "$agentcap."
DEFAULT_MAX_PAYLOAD_CHARS: Final = 256 * 1024
_MAX_DEPTH: Final = 64
_MAX_REPR: Final = 2000
#: Values visited in one conversion before the rest become ``$agentcap.repr`` markers. Each value
#: takes at least two characters of JSON, so a payload with more is over the default size limit
#: (and truncated) anyway.
_MAX_VALUES: Final = 300_000
#: Ints this long (about 4,200 decimal digits) are written in hex, which has no length limit.
_MAX_INT_BITS: Final = 14_000


def _bad_str(value: str) -> bool:
    if "\x00" in value:
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _encode_str(value: str) -> Any:
    if _bad_str(value):
        raw = value.encode("utf-8", "surrogatepass")
        return {"$agentcap.str": base64.b64encode(raw).decode("ascii")}
    return value


_reprs = reprlib.Repr()
_reprs.maxstring = _MAX_REPR
_reprs.maxother = _MAX_REPR


def _type_name(value: Any) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def _repr(value: Any, text: str | None = None) -> dict[str, str]:
    """The ``$agentcap.repr`` marker of ``value`` (with ``text`` instead of its repr if given)."""
    if text is None:
        try:
            # reprlib bounds the work on big or nested containers (and writes a cycle as [...]);
            # other objects get their own __repr__, cut.
            text = (
                _reprs.repr(value)
                if isinstance(value, list | tuple | set | frozenset | dict)
                else repr(value)
            )
        except Exception as exc:  # a broken __repr__ must not lose the rest of the payload
            text = f"<unrepresentable: {type(exc).__name__}>"
    return {"$agentcap.repr": _encode_plain(text[:_MAX_REPR]), "type": _type_name(value)}


def _encode_plain(value: str) -> str:
    return value.encode("utf-8", "replace").decode("utf-8").replace("\x00", "\\u0000")


class _Walk:
    """One conversion: the containers on the current path (a container met again inside itself
    is a cycle) and how many values may still be visited (shared sub-structures can make a small
    object expand to exponentially many values)."""

    __slots__ = ("active", "budget")

    def __init__(self) -> None:
        self.active: set[int] = set()
        self.budget = _MAX_VALUES


def to_jsonable(value: Any) -> Any:
    """Convert ``value`` to plain JSON types, applying the markers described in the module doc.
    Never raises for a value inside a container: a value that cannot be converted becomes a
    ``$agentcap.repr`` marker in place, and the rest is kept."""
    return _convert(value, 0, _Walk())


def _convert(value: Any, depth: int, walk: _Walk) -> Any:
    walk.budget -= 1
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value.bit_length() > _MAX_INT_BITS:
            # str() refuses ints of more than sys.get_int_max_str_digits() digits; hex does not.
            return {"$agentcap.int": hex(value)}
        return int(value)
    if isinstance(value, str):
        return _encode_str(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {
            "$agentcap.float": "NaN"
            if math.isnan(value)
            else ("Infinity" if value > 0 else "-Infinity")
        }
    if depth >= _MAX_DEPTH or walk.budget < 0:
        return _repr(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$agentcap.bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, Mapping | list | tuple | set | frozenset):
        if id(value) in walk.active:
            # A cycle: marked as Python's repr marks one.
            return _repr(value, "{...}" if isinstance(value, Mapping) else "[...]")
        walk.active.add(id(value))
        try:
            if isinstance(value, Mapping):
                return _convert_mapping(value, depth, walk)
            return [_child(item, depth, walk) for item in _ordered(value)]
        finally:
            walk.active.discard(id(value))
    if isinstance(value, enum.Enum):
        return _child(value.value, depth, walk)
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    try:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return _convert(dataclasses.asdict(value), depth + 1, walk)
        dump = getattr(value, "model_dump", None)
        if callable(dump):
            return _convert(dump(mode="json"), depth + 1, walk)
    except Exception:
        pass  # a failing asdict, model_dump or __getattr__: fall back to the repr
    return _repr(value)


def _child(value: Any, depth: int, walk: _Walk) -> Any:
    try:
        return _convert(value, depth + 1, walk)
    except Exception:
        return _repr(value)


def _ordered(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        try:
            return sorted(value, key=repr)
        except Exception:
            return list(value)
    return value


def _convert_mapping(value: Mapping[Any, Any], depth: int, walk: _Walk) -> Any:
    out: dict[str, Any] = {}
    pairs: list[tuple[Any, Any]] = []  # (original key, converted value)
    lossless = True
    for key, item in value.items():
        try:
            skey = _json_key(key)
        except Exception:
            skey, lossless = f"<{type(key).__name__}>", False
        if _bad_str(skey):
            skey, lossless = _encode_plain(skey), False
        if skey in out:
            lossless = False  # two keys that read the same as JSON object keys
        converted = out[skey] = _child(item, depth, walk)
        pairs.append((key, converted))
    if not lossless:
        # JSON object keys cannot hold these keys apart: keep every pair, keys converted as
        # values (a bad string becomes a $agentcap.str marker).
        return {"$agentcap.items": [[_child(key, depth, walk), item] for key, item in pairs]}
    if any(key.startswith(MARKER_PREFIX) for key in out):
        return {"$agentcap.literal": out}
    return out


def _not_json(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON")


# json's C encoder, built once: ``JSONEncoder.encode`` builds one on every call, which costs as much
# as encoding a small payload. Arguments: markers, default, string encoder, indent, key and item
# separators, sort_keys, skipkeys, allow_nan. Without markers there is no cycle check; a cycle ends
# in RecursionError, which sends the value to the general path (to_jsonable bounds the depth).
_c_make_encoder: Any = getattr(json.encoder, "c_make_encoder", None)
_c_encoder: Any = (
    _c_make_encoder(
        None, _not_json, json.encoder.encode_basestring, None, ":", ",", False, False, False
    )
    if _c_make_encoder is not None
    else None
)
_c_sorted_encoder: Any = (
    _c_make_encoder(
        None, _not_json, json.encoder.encode_basestring, None, ":", ",", True, False, False
    )
    if _c_make_encoder is not None
    else None
)
_py_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode
_py_encode_sorted = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, separators=(",", ":"), sort_keys=True
).encode


#: Where a dict key that was not a str could be in JSON ``_encode`` wrote: json writes an int or
#: float key as its digits (or ``NaN``, ``Infinity``, ``-Infinity``), ``True``, ``False`` and
#: ``None`` as ``true``, ``false``, ``null``, each quoted, right after ``{`` or ``,``. Only such a
#: key can duplicate another key of its dict. Other text may match too (a list of strings that
#: start with a digit); that only costs the check below.
_MAYBE_NON_STR_KEY: Final = re.compile(r'[{,]"(?:-?[0-9I]|NaN|true"|false"|null")')
#: The key types of a dict whose keys need no scan of its text (see dumps).
_STR_ONLY: Final = frozenset({str})


def _encode(value: Any, sort_keys: bool = False) -> str:
    """``json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"),
    sort_keys=sort_keys)``."""
    encoder = _c_sorted_encoder if sort_keys else _c_encoder
    if encoder is None:
        return _py_encode_sorted(value) if sort_keys else _py_encode(value)
    return "".join(encoder(value, 0))


def _json_key(key: Any) -> str:
    """A dict key as ``json.dumps`` writes it (``True`` -> ``"true"``, ``None`` -> ``"null"``),
    so the fast and the general path of :func:`dumps` agree."""
    if isinstance(key, str):
        return key
    if key is True or key is False or key is None:
        return json.dumps(key)
    return str(key)


def _jsonb_safe(text: str) -> bool:
    """Whether JSON text produced by ``json.dumps(ensure_ascii=False)`` can go to jsonb as is:
    no NUL escape, no lone surrogate, no key or string that could read as one of our markers.
    (A literal backslash-u0000 in user text also fails this; it then takes the general path.)"""
    if "\\u0000" in text or '"$agentcap.' in text:
        return False
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def dumps(
    value: Any, max_chars: int = DEFAULT_MAX_PAYLOAD_CHARS, *, sort_keys: bool = False
) -> str:
    """Serialise ``value`` to a JSON text that jsonb accepts, never raising.

    A result longer than ``max_chars`` is replaced by a ``$agentcap.truncated`` marker that keeps
    the first ``max_chars // 2`` characters, so huge payloads are recorded, bounded, and visible.
    With ``sort_keys`` every object's keys are sorted, so equal values of any key order give one
    text (the canonical form tool inputs are compared by).
    """
    try:
        # Fast path: most payloads are plain JSON; json.dumps in C plus a scan of its output is
        # far cheaper than walking the value in Python. Anything else takes the general path.
        if sort_keys or _c_encoder is None:
            text = _encode(value, sort_keys)
        else:
            text = "".join(_c_encoder(value, 0))
    except (TypeError, ValueError, RecursionError):
        return _general(value, max_chars, sort_keys)
    return _checked(value, text, max_chars, sort_keys)


def dumps_plain(value: Any, max_chars: int = DEFAULT_MAX_PAYLOAD_CHARS) -> tuple[str, bool]:
    """:func:`dumps` (keys in their order), and whether json's own encoder took ``value`` as it
    is. Then ``value`` holds nothing but dicts, lists, tuples, str, int, float, True, False and
    None, or instances of their subclasses (json's encoder refuses anything else, and a float
    that JSON cannot hold)."""
    if _c_encoder is None:
        return dumps(value, max_chars), False
    try:
        text = "".join(_c_encoder(value, 0))
    except (TypeError, ValueError, RecursionError):
        return _general(value, max_chars, False), False
    if (
        # _checked's answer when the text holds no object, or one, the value itself, a dict whose
        # keys are all str (no key to scan), inlined: every tool call encodes its result here.
        text.find("{", 1) < 0
        and (text[:1] != "{" or (type(value) is dict and _STR_ONLY.issuperset(map(type, value))))
        and text.isascii()
        and len(text) <= max_chars
        and "\\u0000" not in text
        and '"$agentcap.' not in text
    ):
        return text, True
    return _checked(value, text, max_chars, False), True


def dumps_str_keyed(value: dict[str, Any], max_chars: int = DEFAULT_MAX_PAYLOAD_CHARS) -> str:
    """:func:`dumps` of a dict whose keys are all str (a call's bound arguments, say), which
    spares checking its own keys."""
    if _c_encoder is None:
        return dumps(value, max_chars)
    try:
        text = "".join(_c_encoder(value, 0))
    except (TypeError, ValueError, RecursionError):
        return _general(value, max_chars, False)
    if (
        # _checked's answer when no dict is nested (no key to scan), inlined: every tool call
        # encodes its arguments here.
        text.find("{", 1) < 0
        and text.isascii()
        and len(text) <= max_chars
        and "\\u0000" not in text
        and '"$agentcap.' not in text
    ):
        return text
    return _checked(value, text, max_chars, False, True)


def _checked(
    value: Any, text: str, max_chars: int, sort_keys: bool, str_keyed: bool = False
) -> str:
    """:func:`dumps` given ``text``, what json's encoder wrote for ``value``: the text when jsonb
    can hold it as it is (cut to ``max_chars``), else the general path's. ``str_keyed``: the
    caller knows ``value`` is a dict whose keys are all str."""
    try:
        # (_jsonb_safe and truncate inlined for the common case: this runs twice for every
        # captured tool call.)
        if not sort_keys:
            # Only a dict's key can be a non-str key. When the text has no "{" but the value's own
            # (a dict, not a subclass, whose keys are all str) or none at all, no key can be one,
            # and the text needs no scan.
            if text.find("{", 1) >= 0:
                scan = True
            elif text[:1] == "{" and not str_keyed:
                scan = type(value) is not dict or not _STR_ONLY.issuperset(map(type, value))
            else:
                scan = False
            if scan and _MAYBE_NON_STR_KEY.search(text) is not None:
                # json writes the keys 0 and "0" of one dict both as "0": duplicate keys, of which
                # jsonb keeps one. Sorting the keys of a dict that mixes str keys with other keys
                # raises TypeError (and no two keys of other types read the same): such values
                # take the general path, which keeps every pair. (The sorted text is not used.)
                _encode(value, sort_keys=True)
        if (
            text.isascii()
            and len(text) <= max_chars
            and "\\u0000" not in text
            and '"$agentcap.' not in text
        ):
            return text
        fast = _jsonb_safe(text)
    except (TypeError, ValueError, RecursionError):
        fast = False
    if fast:
        return truncate(text, max_chars)
    return _general(value, max_chars, sort_keys)


def _general(value: Any, max_chars: int, sort_keys: bool) -> str:
    """:func:`dumps` by the general path: the value converted by :func:`to_jsonable` first."""
    try:
        text = _encode(to_jsonable(value), sort_keys)
    except Exception as exc:  # recursion limits and the like: keep a record rather than nothing
        text = json.dumps({"$agentcap.error": f"{type(exc).__name__}: could not encode payload"})
    return truncate(text, max_chars)


def truncate(text: str, max_chars: int = DEFAULT_MAX_PAYLOAD_CHARS) -> str:
    """``text`` (JSON written by :func:`dumps`), or its ``$agentcap.truncated`` marker when it is
    longer than ``max_chars``."""
    if len(text) <= max_chars:
        return text
    size = len(text)
    keep = max_chars // 2
    while True:  # escaping can grow the kept prefix; shrink it until the marker fits
        marker = json.dumps(
            {"$agentcap.truncated": _encode_plain(text[:keep]), "size": size},
            ensure_ascii=False,
        )
        if len(marker) <= max_chars or keep == 0:
            return marker
        keep //= 2


#: Markers :func:`from_jsonable` turns back into the value they stand for. The others
#: (``$agentcap.repr``, ``$agentcap.truncated``, ``$agentcap.unparsed``, ``$agentcap.error``)
#: recorded only a description of a value, and are returned as they are.
LOSSLESS_MARKERS: Final = frozenset(
    {
        "$agentcap.bytes",
        "$agentcap.float",
        "$agentcap.str",
        "$agentcap.int",
        "$agentcap.items",
        "$agentcap.literal",
    }
)


def from_jsonable(value: Any) -> Any:
    """The inverse of :func:`to_jsonable` where it can be: ``bytes`` for a bytes marker, the
    float of a NaN or infinity marker, the ``str`` of a string marker, the ``int`` of a long-int
    marker, a dict with its original keys for an items marker, and the user's own dict for a
    literal marker. Everything else JSON holds comes back as JSON types (a tuple as a list, a
    dataclass as a dict); a marker that only describes a value (``$agentcap.repr``, a truncation)
    comes back as that marker dict. Never raises: a malformed marker is returned as it is."""
    if isinstance(value, list):
        return [from_jsonable(item) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((key, inner),) = value.items()
        if key in LOSSLESS_MARKERS:
            try:
                return _decode_marker(key, inner)
            except Exception:
                return value
    return {key: from_jsonable(item) for key, item in value.items()}


def _decode_marker(key: str, inner: Any) -> Any:
    if key == "$agentcap.bytes":
        return base64.b64decode(inner, validate=True)
    if key == "$agentcap.float":
        if inner not in ("NaN", "Infinity", "-Infinity"):
            raise ValueError(inner)
        return float(inner)
    if key == "$agentcap.str":
        return base64.b64decode(inner, validate=True).decode("utf-8", "surrogatepass")
    if key == "$agentcap.int":
        return int(inner, 16)
    if key == "$agentcap.items":
        out: dict[Any, Any] = {}
        for pair_key, item in inner:
            out[from_jsonable(pair_key)] = from_jsonable(item)
        return out
    # $agentcap.literal: a user dict whose own keys start with the marker prefix.
    if not isinstance(inner, dict):
        raise TypeError(type(inner).__name__)
    return {k: from_jsonable(v) for k, v in inner.items()}


class EncodedObject(dict[str, Any]):
    """A JSON object already in this module's encoding (parsed from text :func:`dumps` wrote,
    markers and all): storage keeps it as it is instead of encoding it again, which would read
    its markers as user keys (``$agentcap.literal``)."""

    __slots__ = ()


class RawJson(str):
    """JSON text known to be valid and jsonb-safe, passed to storage as is (no parse and dump
    round trip). Only the exporters use it; events for users carry parsed payloads."""

    __slots__ = ()


def raw_or_loads(text: str, *, too_deep: Literal["keep", "raise"] = "keep") -> Any:
    """``RawJson(text)`` for text free of what jsonb rejects even in valid JSON (NUL escapes,
    surrogate escapes, lone surrogates), else :func:`loads`. Validity as JSON is not checked here:
    parsing costs more than the write itself, so the exporter lets PostgreSQL check and, if it
    rejects a batch, maps it again with :func:`loads` (see ``PostgresSpanExporter``)."""
    # One scan for a backslash, which many payloads lack (a one-character search is the
    # fastest), then for the three escapes that matter.
    if "\\" in text and ("\\u0000" in text or "\\ud" in text or "\\uD" in text):
        return loads(text, too_deep=too_deep)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return loads(text, too_deep=too_deep)
    return RawJson(text)


def gives_marker(text: str) -> bool:
    """Whether :func:`loads` (``too_deep="keep"``) gives ``text`` back as its
    ``$agentcap.unparsed`` marker: text that is not JSON, or nested too deeply."""
    try:
        json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return True
    return False


def loads(text: str | None, *, too_deep: Literal["keep", "raise"] = "keep") -> Any:
    """Parse a payload attribute; text that is not JSON (e.g. cut by an attribute length limit),
    or JSON nested deeper than the parser recurses, comes back as ``{"$agentcap.unparsed":
    <text>}`` instead of being lost. With ``too_deep="raise"`` the latter is a RecursionError (an
    import reports it instead of storing a marker in place of a value it was given)."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except RecursionError:
        if too_deep == "raise":
            raise
        return {"$agentcap.unparsed": _encode_plain(str(text))}
    except (ValueError, TypeError):
        return {"$agentcap.unparsed": _encode_plain(str(text))}
