"""jsonsafe: the documented encodings, jsonb-safe output and truncation."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import enum
import json
import math
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_agentcap import jsonsafe


def _reject_constant(name: str) -> None:
    raise AssertionError(f"non-standard JSON constant {name}")


def _jsonb_safe(text: str) -> object:
    """Parse as strict JSON and check nothing jsonb rejects is in it; return the value."""
    text.encode("utf-8")  # no lone surrogates
    value = json.loads(text, parse_constant=_reject_constant)

    def walk(v: object) -> None:
        if isinstance(v, str):
            assert "\x00" not in v
            v.encode("utf-8")
        elif isinstance(v, list):
            for item in v:
                walk(item)
        elif isinstance(v, dict):
            for k, item in v.items():
                walk(k)
                walk(item)

    walk(value)
    return value


def test_bytes_marker():
    """bytes and bytearray become $agentcap.bytes with base64."""
    assert jsonsafe.to_jsonable(b"\x00\x01hi") == {"$agentcap.bytes": "AAFoaQ=="}
    assert jsonsafe.to_jsonable(bytearray(b"x")) == {"$agentcap.bytes": "eA=="}


def test_float_markers():
    """NaN and infinities become $agentcap.float; finite floats stay numbers."""
    assert jsonsafe.to_jsonable(math.nan) == {"$agentcap.float": "NaN"}
    assert jsonsafe.to_jsonable(math.inf) == {"$agentcap.float": "Infinity"}
    assert jsonsafe.to_jsonable(-math.inf) == {"$agentcap.float": "-Infinity"}
    assert jsonsafe.to_jsonable(1.5) == 1.5


def test_bad_strings_marker_round_trips():
    """Strings with NUL or a lone surrogate become $agentcap.str and decode back exactly."""
    for s in ["a\x00b", "x\ud800y", "\udfff"]:
        marker = jsonsafe.to_jsonable(s)
        assert set(marker) == {"$agentcap.str"}
        assert base64.b64decode(marker["$agentcap.str"]).decode("utf-8", "surrogatepass") == s
    assert jsonsafe.to_jsonable("plain \u00e9") == "plain \u00e9"


def test_repr_marker_for_unknown_objects():
    """Other objects become $agentcap.repr with their qualified type, even with a broken __repr__."""

    class Odd:
        def __repr__(self) -> str:
            return "Odd\x00<\ud800>"

    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    odd = jsonsafe.to_jsonable(Odd())
    assert odd["type"].endswith("Odd") and odd["type"].startswith(__name__)
    assert "\x00" not in odd["$agentcap.repr"]
    _jsonb_safe(jsonsafe.dumps(Odd()))
    assert jsonsafe.to_jsonable(Broken())["$agentcap.repr"] == "<unrepresentable: RuntimeError>"
    assert (
        len(
            jsonsafe.to_jsonable(type("Long", (), {"__repr__": lambda s: "x" * 5000})())[
                "$agentcap.repr"
            ]
        )
        == 2000
    )


def test_containers_dataclasses_and_model_dump():
    """Tuples, sets, non-str keys, enums, dates, UUIDs, dataclasses and model_dump() are converted."""

    class Color(enum.Enum):
        RED = "red"

    @dataclasses.dataclass
    class Point:
        x: int
        y: bytes

    class Model:
        def model_dump(self, mode: str) -> dict[str, object]:
            assert mode == "json"
            return {"m": 1}

    u = uuid.UUID(int=5)
    value = {
        1: (1, 2),
        "s": {3, 1, 2},
        "e": Color.RED,
        "d": datetime.date(2024, 1, 2),
        "u": u,
        "p": Point(1, b"z"),
        "m": Model(),
    }
    assert jsonsafe.to_jsonable(value) == {
        "1": [1, 2],
        "s": [1, 2, 3],
        "e": "red",
        "d": "2024-01-02",
        "u": str(u),
        "p": {"x": 1, "y": {"$agentcap.bytes": "eg=="}},
        "m": {"m": 1},
    }


def test_user_dict_never_reads_as_a_marker():
    """A user dict shaped like a marker (one or several $agentcap.* keys) is wrapped as a literal."""
    for user in [
        {"$agentcap.bytes": "AA=="},
        {"$agentcap.repr": "x", "type": "y"},
        {"$agentcap.truncated": "x", "size": 3},
    ]:
        assert jsonsafe.to_jsonable(user) == {"$agentcap.literal": user}
    assert jsonsafe.to_jsonable({"a": 1, "b": 2}) == {"a": 1, "b": 2}


def test_deep_nesting_is_bounded():
    """Nesting deeper than json can encode is cut with a repr marker rather than failing."""
    deep: list[object] = []
    cur = deep
    for _ in range(5000):
        nxt: list[object] = []
        cur.append(nxt)
        cur = nxt
    _jsonb_safe(jsonsafe.dumps(deep))
    assert "$agentcap.repr" in jsonsafe.dumps(deep)


def test_truncation_marker_for_huge_payloads():
    """A payload over max_chars becomes $agentcap.truncated with the first half and the full size."""
    big = {"data": "y" * 10_000}
    full = jsonsafe.dumps(big, max_chars=10**9)
    text = jsonsafe.dumps(big, max_chars=1000)
    value = _jsonb_safe(text)
    assert value == {"$agentcap.truncated": full[:500], "size": len(full)}
    assert len(text) < 1100


def test_dumps_never_raises_on_self_reference():
    """A self-referencing structure still produces valid JSON."""
    loop: list[object] = []
    loop.append(loop)
    _jsonb_safe(jsonsafe.dumps(loop))


def test_loads_keeps_unparsable_text():
    """Text that is not JSON comes back as $agentcap.unparsed; None stays None."""
    assert jsonsafe.loads('{"a": 1') == {"$agentcap.unparsed": '{"a": 1'}
    assert jsonsafe.loads(None) is None
    assert jsonsafe.loads("[1]") == [1]
    deep = "[" * 100_000 + "]" * 100_000  # deeper than the parser recurses
    assert jsonsafe.loads(deep) == {"$agentcap.unparsed": deep}
    with pytest.raises(RecursionError):
        jsonsafe.loads(deep, too_deep="raise")


json_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text().filter(lambda s: "\x00" not in s),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.text(max_size=5).filter(
                lambda k: "\x00" not in k and not k.startswith("$agentcap.")
            ),
            children,
            max_size=4,
        )
    ),
    max_leaves=20,
)

anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text()
    | st.binary(max_size=8)
    | st.builds(object)
    | st.characters(codec=None).map(lambda c: c + "\x00"),
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=5) | st.integers(), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(json_plain)
def test_plain_json_round_trips_unchanged(value):
    """Values JSON can hold (strings without NUL, finite floats) round trip unchanged."""
    assert json.loads(jsonsafe.dumps(value)) == value


@settings(max_examples=200, deadline=None)
@given(anything)
def test_anything_encodes_to_jsonb_safe_text(value):
    """Any value encodes to strict JSON with no NUL, no NaN and no lone surrogate anywhere."""
    _jsonb_safe(jsonsafe.dumps(value))


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1, max_size=30))
def test_any_string_is_recoverable(s):
    """Every string either survives as itself or as a $agentcap.str marker that decodes to it."""
    out = json.loads(jsonsafe.dumps(s))
    if isinstance(out, dict):
        assert base64.b64decode(out["$agentcap.str"]).decode("utf-8", "surrogatepass") == s
    else:
        assert out == s


@settings(max_examples=300, deadline=None)
@given(anything)
def test_fast_path_matches_general_encoding(value):
    """dumps gives exactly the text of encoding to_jsonable(value), fast path or not."""
    expected = json.dumps(
        jsonsafe.to_jsonable(value), ensure_ascii=False, allow_nan=False, separators=(",", ":")
    )
    assert jsonsafe.dumps(value, max_chars=10**9) == expected


def test_fast_path_agrees_with_general_path_on_keys():
    """Bool and None keys, marker keys and tuples encode as the general path does."""
    for value in [{True: 1, None: 2}, {"$agentcap.x": 1, "y": 2}, ("a", ("b",)), {1.5: "x"}]:
        expected = json.dumps(
            jsonsafe.to_jsonable(value), ensure_ascii=False, allow_nan=False, separators=(",", ":")
        )
        assert jsonsafe.dumps(value, max_chars=10**9) == expected


def test_truncated_marker_stays_within_the_limit_even_when_escaping_grows_it():
    """A truncated payload full of characters JSON escapes still fits in max_chars."""
    text = jsonsafe.dumps({"s": "\x01" * 10_000}, max_chars=1_000)
    assert len(text) <= 1_000
    assert json.loads(text)["$agentcap.truncated"]


def test_cyclic_value_is_recorded_bounded():
    """A value that contains itself is encoded to a bounded depth, never raising or looping."""
    items: list[object] = [1]
    items.append(items)
    text = jsonsafe.dumps({"k": items})
    value = _jsonb_safe(text)
    assert isinstance(value, dict) and value["k"][0] == 1
    assert "$agentcap.repr" in text


def test_a_container_inside_itself_is_a_marker_in_place():
    """Cycles end at a $agentcap.repr marker; the rest of the payload is kept (and nothing hangs:
    a list holding itself twice used to expand to 2**64 values)."""
    wide: list[object] = ["keep-me"]
    wide.append(wide)
    wide.append(wide)
    looped: dict[str, object] = {"name": "x"}
    looped["self"] = looped
    value = jsonsafe.loads(jsonsafe.dumps({"wide": wide, "looped": looped}))
    assert value["wide"][0] == "keep-me"
    assert value["wide"][1] == {"$agentcap.repr": "[...]", "type": "builtins.list"}
    assert value["looped"]["name"] == "x"
    assert value["looped"]["self"] == {"$agentcap.repr": "{...}", "type": "builtins.dict"}


@pytest.mark.timeout(30)
def test_shared_substructures_are_bounded():
    """A small object that expands to 2**40 values (not JSON, so the general path walks it) is
    cut at the value budget instead of running for ever."""
    node: object = [complex(1, 2)]
    for _ in range(40):
        node = [node, node]
    text = jsonsafe.dumps(node)
    assert '"$agentcap.repr"' in text or '"$agentcap.truncated"' in text


def test_huge_ints_are_kept_in_hex_next_to_the_other_values():
    big = 10**5000
    value = jsonsafe.loads(jsonsafe.dumps([1, big, "keep-me", -big]))
    assert value[0] == 1 and value[2] == "keep-me"
    assert int(value[1]["$agentcap.int"], 16) == big
    assert int(value[3]["$agentcap.int"], 16) == -big


def test_a_value_that_cannot_be_converted_costs_only_its_own_place():
    class BadRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    class BadStr:
        def __str__(self) -> str:
            raise RuntimeError("no str")

        def __repr__(self) -> str:
            return "BadStr()"

        def __hash__(self) -> int:
            return 1

    class BadAttributes:
        def __getattr__(self, name: str) -> object:
            raise RuntimeError(f"no {name}")

        def __repr__(self) -> str:
            return "BadAttributes()"

    value = jsonsafe.loads(
        jsonsafe.dumps(
            {
                "set": {BadRepr(), BadRepr()},
                "keys": {BadStr(): 1, "ok": 2},
                "object": BadAttributes(),
                "keep": "me",
            }
        )
    )
    assert value["keep"] == "me"
    assert len(value["set"]) == 2
    assert value["keys"]["$agentcap.items"][1] == ["ok", 2]
    assert value["keys"]["$agentcap.items"][0][0]["$agentcap.repr"] == "BadStr()"
    assert value["object"]["$agentcap.repr"] == "BadAttributes()"


def test_keys_jsonb_cannot_hold_are_kept_apart():
    """Keys with NUL or a lone surrogate used to be replaced, and then collided with real keys."""
    value = jsonsafe.loads(jsonsafe.dumps({"a\x00": 1, "a\\u0000": 2, "a\ud800": 3, "a?": 4}))
    pairs = value["$agentcap.items"]
    assert [pair[1] for pair in pairs] == [1, 2, 3, 4]
    assert base64.b64decode(pairs[0][0]["$agentcap.str"]) == b"a\x00"
    assert pairs[1][0] == "a\\u0000" and pairs[3][0] == "a?"
    assert (
        base64.b64decode(pairs[2][0]["$agentcap.str"]).decode("utf-8", "surrogatepass") == "a\ud800"
    )


@pytest.mark.parametrize(
    "value",
    [
        {"0": None, 0: None},
        {"true": 1, True: 2},
        {"null": 1, None: 2},
        {"1.5": "a", 1.5: "b"},
        [{"x": 1}, {"7": "str key", 7: "int key"}],
        {"outer": {"2": 1, 2: 2}},
        {"-1": "a", -1: "b"},
        {"x": 0, "-0.5": "a", -0.5: "b"},
        [{"false": 1, False: 2}],
    ],
)
def test_keys_that_read_the_same_in_json_are_all_kept(value):
    """A dict whose keys differ in Python but read the same as JSON object keys ("0" and 0) is
    recorded with every pair, not as an object with duplicate keys (jsonb would keep one)."""
    expected = json.dumps(
        jsonsafe.to_jsonable(value), ensure_ascii=False, allow_nan=False, separators=(",", ":")
    )
    assert jsonsafe.dumps(value, max_chars=10**9) == expected
    assert "$agentcap.items" in expected


#: Keys of every type json writes, drawn from a small set so that pairs reading the same
#: (0 and "0", -1.5 and "-1.5", None and "null") meet often.
mixed_keys = st.sampled_from(
    [
        *(0, "0", 7, "7", -1, "-1", 1.5, "1.5", -0.5, "-0.5", 1e100, "1e+100", True, "true"),
        *(False, "false", None, "null", float("inf"), "Infinity", float("-inf"), "x", ""),
    ]
)


@settings(max_examples=400, deadline=None)
@given(
    st.recursive(
        st.integers(),
        lambda children: st.lists(children, max_size=3)
        | st.dictionaries(mixed_keys, children, max_size=4),
        max_leaves=12,
    )
)
def test_keys_of_every_type_encode_as_the_general_path(value):
    """Whatever mix of key types a dict has, at any depth, dumps writes what the general path
    writes: every pair kept, never two keys that read the same."""
    expected = json.dumps(
        jsonsafe.to_jsonable(value), ensure_ascii=False, allow_nan=False, separators=(",", ":")
    )
    assert jsonsafe.dumps(value, max_chars=10**9) == expected


@settings(max_examples=400, deadline=None)
@given(anything, st.integers(min_value=1, max_value=120))
def test_the_fast_encoders_write_what_dumps_writes(value: Any, max_chars: int) -> None:
    """dumps_plain and dumps_str_keyed answer early when no key needs a look; whatever the value
    and limit, their text is dumps' text."""
    expected = jsonsafe.dumps(value, max_chars)
    assert jsonsafe.dumps_plain(value, max_chars)[0] == expected
    keyed = {f"k{i}": item for i, item in enumerate(value if type(value) is list else [value])}
    assert jsonsafe.dumps_str_keyed(keyed, max_chars) == jsonsafe.dumps(keyed, max_chars)


def test_dumps_plain_writes_what_dumps_writes_and_says_whether_json_took_the_value() -> None:
    """dumps_plain gives dumps' text, and True exactly when json's own encoder took the value as
    it is (JSON's types or their subclasses, finite floats)."""

    class Name(str):
        pass

    class Keys(dict[Any, Any]):
        pass

    cases: list[tuple[Any, bool]] = [
        ({"a": [1, 2.5, None, True], "t": (1, "x")}, True),
        ([Name("n"), {1: "a", "1": "b"}], True),
        ({"big": "x" * 300}, True),
        ({"raw": b"xy"}, False),
        ([float("nan")], False),
        ({1, 2}, False),
        ({"$agentcap.x": 1}, True),
        ({1: "a", "1": "b"}, True),
        (Keys({1: "a", "1": "b"}), True),
        ({"city": "Tromsø", "nul": "a\x00", "lone": "\ud800"}, True),
        (["$agentcap.items", '"$agentcap.str"'], True),
        ({"fits": "z" * 89}, True),
        ({"over": "z" * 90}, True),
    ]
    for value, plain in cases:
        assert jsonsafe.dumps_plain(value, 100) == (jsonsafe.dumps(value, 100), plain)


def test_dumps_str_keyed_writes_what_dumps_writes() -> None:
    """dumps_str_keyed (a dict with str keys) gives dumps' text, nested non-str keys included."""
    cases: list[dict[str, Any]] = [
        {"city": "Oslo", "days": 2},
        {"0": 1, "true": [None]},
        {"inner": {0: "a", "0": "b"}},
        {"inner": {1: "a", 2: "b"}, "raw": b"x"},
        {"$agentcap.str": "x", "long": "y" * 200},
        {"city": "Tromsø", "nul": "a\x00b", "lone": "\ud800"},
        {"value": '"$agentcap.str"', "list": ["$agentcap.items"]},
        {"fits": "z" * 89},  # exactly 100 characters
        {"over": "z" * 90},
    ]
    for value in cases:
        assert jsonsafe.dumps_str_keyed(value, 100) == jsonsafe.dumps(value, 100)


def test_raw_or_loads_parses_only_text_with_what_jsonb_rejects():
    """raw_or_loads passes text as RawJson unless it holds a NUL escape, a surrogate escape (any
    case) or a lone surrogate, which it parses and makes safe."""
    for text in ('{"v": "\\u00e9"}', '{"v": 1}', '"é"', "not json"):
        assert type(jsonsafe.raw_or_loads(text)) is jsonsafe.RawJson
    for text in ('{"v": "\\u0000"}', '"\\ud800"', '"\\uD800"', '"a\\u00e9\\uDC00"', '"\ud800"'):
        assert type(jsonsafe.raw_or_loads(text)) is not jsonsafe.RawJson
