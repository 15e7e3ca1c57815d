"""Private copies of values (capture.values): a copy nobody else holds, with the structure of the
original, as ``copy.deepcopy`` makes it."""

from __future__ import annotations

import copy
import uuid
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

import otel_agentcap as ac
from otel_agentcap.capture.values import private_copy


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
