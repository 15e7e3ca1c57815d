"""Private copies of values (capture.values): a copy nobody else holds, with the structure of the
original, as ``copy.deepcopy`` makes it."""

from __future__ import annotations

import copy
import uuid
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

import otel_agentcap as ac
from otel_agentcap.capture.values import frozen, private_copy, thawed


def _containers(value: Any) -> list[Any]:
    """Every dict, list and tuple of ``value`` in visiting order (each visit listed)."""
    found: list[Any] = []

    def visit(item: Any, depth: int) -> None:
        if isinstance(item, (dict, list, tuple)) and depth < 6:
            found.append(item)
            for inner in item.values() if isinstance(item, dict) else item:
                visit(inner, depth + 1)

    visit(value, 0)
    return found


@given(
    shared=st.lists(st.lists(st.integers(), max_size=3), min_size=1, max_size=4),
    layout=st.lists(
        st.tuples(st.sampled_from(["list", "dict", "tuple"]), st.integers(0, 3)), max_size=8
    ),
)
def test_a_private_copy_shares_what_the_original_shares_and_nothing_with_it(
    shared: list[list[int]], layout: list[tuple[str, int]]
) -> None:
    """Containers reached twice in a value are one container in its copy (as with
    copy.deepcopy), and the copy holds no mutable container of the original."""
    items: list[Any] = []
    for kind, index in layout:
        piece = shared[index % len(shared)]
        items.append(
            piece if kind == "list" else {"p": piece} if kind == "dict" else (piece, index)
        )
    value = {"items": items, "again": items}
    copied = private_copy(value)
    original, mine = _containers(value), _containers(copied)
    expected = _containers(copy.deepcopy(value))
    assert len(mine) == len(original) == len(expected)
    for i in range(len(original)):
        if not isinstance(original[i], tuple):
            assert mine[i] is not original[i]
        for j in range(i):
            assert (mine[i] is mine[j]) == (expected[i] is expected[j])
    assert copied == value


_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=3) | st.integers(), inner, max_size=3)
    ),
    max_leaves=12,
)


def _types(value: Any) -> list[Any]:
    """The type of every item of ``value``, dict keys included, in visiting order."""
    found: list[Any] = [type(value)]
    if isinstance(value, dict):
        for key, item in value.items():
            found += [type(key), *_types(item)]
    elif isinstance(value, (list, tuple)):
        for item in value:
            found += _types(item)
    return found


@given(value=_plain, shared=st.lists(st.integers(), max_size=2))
def test_a_frozen_value_thaws_into_new_copies_of_the_same_plain_data(
    value: Any, shared: list[int]
) -> None:
    """Plain data (what json's encoder takes) frozen and thawed comes back equal, with the same
    types and key order, sharing what it shared, and holding no container of the original."""
    whole = {"value": value, "a": shared, "b": shared}
    kept = frozen(whole)
    assert kept is not None
    first, second = thawed(kept), thawed(kept)
    assert first == whole == second and first is not second
    assert list(first) == list(whole) and _types(first) == _types(whole)
    assert first["a"] is first["b"] and first["a"] is not shared
    assert all(
        mine is not theirs
        for mine, theirs in zip(_containers(first), _containers(whole), strict=True)
        if not isinstance(theirs, tuple)
    )


def test_nothing_but_plain_data_is_frozen() -> None:
    """Subclasses of the plain types (which json's encoder takes too) are not frozen: their
    copies would lose their type."""

    class Name(str):
        pass

    class Number(int):
        pass

    class Row(dict[str, Any]):
        pass

    for value in ({"k": Name("n")}, [Number(1)], {"k": Row()}, {Name("k"): 1}):
        assert frozen(value) is None


def test_a_replayed_result_and_a_memory_value_keep_their_shared_parts() -> None:
    """A tool result or memory value whose two keys name one dict comes back (replay, read) with
    one dict under both keys: a change through one is seen through the other, as in the value
    the tool returned."""
    row = {"v": 1}

    @ac.tool
    def lookup() -> dict[str, Any]:
        return {"a": row, "b": row}

    with ac.run(f"values-{uuid.uuid4().hex[:8]}"), ac.agent("a"):
        lookup.invoke("i")
        again = lookup.invoke("i")
        again["a"]["v"] = 2
        assert again["b"]["v"] == 2
        memory = ac.Memory("m")
        memory["k"] = {"a": row, "b": row}
        read = memory["k"]
        read["a"]["v"] = 3
        assert read["b"]["v"] == 3
    assert row == {"v": 1}
