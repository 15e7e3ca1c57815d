"""Captured memory: atomic write events, before/after replay, causal links, missing versus None."""

from __future__ import annotations

import json
import math
import threading
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import otel_agentcap as oa
from otel_agentcap import attributes as attr
from otel_agentcap import jsonsafe
from otel_agentcap.testing import capture_events


def _run_id() -> str:
    return f"mem-{uuid.uuid4().hex[:12]}"


def _replay_chain(writes):
    """Check the write chain of one key and return the value it replays to (None for missing)."""
    writes = sorted(writes, key=lambda e: e.seq)  # one key, possibly several agents
    by_id = {e.event_id: e for e in writes}
    previous = None
    for event in writes:
        p = event.payload
        if previous is None:
            assert p["before_found"] is False
        else:
            assert p["before_found"] == previous.payload["after_found"]
            if p["before_found"]:
                assert p["before"] == previous.payload["after"]
            assert previous.event_id in event.causal_parent_ids
            assert by_id[previous.event_id].seq < event.seq
        previous = event
    return previous


def test_concurrent_writers_chain_replays_to_final_value():
    """Writes from 12 threads in 4 agents form a chain where each before is the previous after."""
    memory = oa.Memory("shared")
    barrier = threading.Barrier(12)

    def writer(i: int) -> None:
        with oa.agent(f"agent-{i % 4}"):
            barrier.wait()
            for j in range(40):
                if j % 10 == 9:
                    memory.delete("counter")
                else:
                    memory["counter"] = [i, j]
                memory["own"] = i

    with capture_events() as captured, oa.run(_run_id()):
        threads = [oa.start_thread(writer, i) for i in range(12)]
        for t in threads:
            t.join()
    writes = [e for e in captured.of_type("memory_write") if e.payload["key"] == "counter"]
    assert len(writes) >= 12 * 36
    last = _replay_chain(writes)
    final = memory.snapshot()
    if last.payload["after_found"]:
        assert final["counter"] == last.payload["after"]
    else:
        assert "counter" not in final
    own = [e for e in captured.of_type("memory_write") if e.payload["key"] == "own"]
    assert _replay_chain(own).payload["after"] == final["own"]


def test_each_write_names_previous_write_as_parent():
    """The second write of a key names the first as causal parent, across agents."""
    memory = oa.Memory()
    with capture_events() as captured, oa.run(_run_id()):
        with oa.agent("alpha"):
            first = memory.set("k", 1)
        with oa.agent("beta"):
            second = memory.set("k", 2)
    events = captured.by_id()
    assert events[second.event_id].causal_parent_ids == (first.event_id,)
    assert events[first.event_id].causal_parent_ids == ()
    assert second.seq > first.seq


def test_write_after_delete_still_chains():
    """A write after a delete names the delete as causal parent and records before_found false."""
    memory = oa.Memory()
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        memory["k"] = 1
        del memory["k"]
        memory["k"] = 2
    w = captured.of_type("memory_write")
    assert [e.payload["op"] for e in w] == ["set", "delete", "set"]
    assert w[1].payload["after_found"] is False and "after" not in w[1].payload
    assert w[2].payload["before_found"] is False and "before" not in w[2].payload
    assert w[2].causal_parent_ids == (w[1].event_id,)


def test_deleted_keys_are_remembered_up_to_a_bound():
    """Keys that come and go do not grow the memory: only the most recent deletes are kept for
    chaining, and a key deleted longer ago starts a new chain on its next write."""
    memory = oa.Memory()
    memory.max_deleted_keys = 3
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        for i in range(10):
            memory[f"scratch-{i}"] = i
            del memory[f"scratch-{i}"]
        assert len(memory._deletes) == 3 and len(memory) == 0
        memory["scratch-9"] = "again"  # recent: chains to its delete
        memory["scratch-0"] = "again"  # forgotten: no parent
    writes = {(e.payload["key"], e.payload["op"]): e for e in captured.of_type("memory_write")}
    again = [e for e in captured.of_type("memory_write") if e.payload.get("after") == "again"]
    assert again[0].causal_parent_ids == (writes[("scratch-9", "delete")].event_id,)
    assert again[1].causal_parent_ids == ()


def test_missing_and_none_differ():
    """A stored None is found; a missing key is not, in lookup, in, get, [] and payloads."""
    memory = oa.Memory()
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        memory["none"] = None
        hit = memory.lookup("none")
        miss = memory.lookup("missing")
        assert hit.found is True and hit.value is None
        assert miss.found is False
        assert "none" in memory
        assert "missing" not in memory
        assert memory.get("none", "default") is None
        assert memory.get("missing", "default") == "default"
        assert memory["none"] is None
        with pytest.raises(KeyError):
            memory["missing"]
        memory["none"] = 1
    reads = captured.of_type("memory_read")
    by_key = {}
    for r in reads:
        by_key.setdefault(r.payload["key"], []).append(r.payload)
    assert all(p["found"] is True and p["value"] is None for p in by_key["none"])
    assert all(p["found"] is False and "value" not in p for p in by_key["missing"])
    writes = captured.of_type("memory_write")
    assert writes[0].payload == {
        "memory": "memory",
        "key": "none",
        "op": "set",
        "before_found": False,
        "after_found": True,
        "after": None,
    }
    assert writes[1].payload["before_found"] is True and writes[1].payload["before"] is None


def test_read_of_other_agents_write_is_caused_by_it():
    """A read of a value written by another agent names that write and has a larger sequence."""
    memory = oa.Memory()
    with capture_events() as captured, oa.run(_run_id()):
        with oa.agent("writer"):
            for i in range(50):
                ref = memory.set("k", i)
        with oa.agent("reader"):
            found = memory.lookup("k")
    assert found.written_by == ref
    read = captured.of_type("memory_read")[0]
    assert read.agent_id == "reader"
    assert read.causal_parent_ids == (ref.event_id,)
    assert read.seq > ref.seq
    assert read.payload["written_by"] == ref.event_id


def test_read_in_another_thread_follows_write():
    """A reader thread in another agent gets a sequence above the write it observed."""
    memory = oa.Memory()
    refs = {}

    def reader() -> None:
        with oa.agent("reader"):
            refs["read"] = memory.lookup("k")

    with capture_events() as captured, oa.run(_run_id()):
        with oa.agent("writer"):
            for i in range(20):
                refs["write"] = memory.set("k", i)
        oa.start_thread(reader).join()
    read = captured.of_type("memory_read")[0]
    assert read.seq > refs["write"].seq
    assert refs["read"].written_by == refs["write"]


def test_delete_of_missing_key_records_nothing():
    """Deleting a key that is not there returns False, raises KeyError via del, and records no event."""
    memory = oa.Memory()
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        assert memory.delete("nope") is False
        with pytest.raises(KeyError):
            del memory["nope"]
    assert captured.of_type("memory_write") == []


def test_non_json_values_are_encoded_safely():
    """Bytes, NaN, infinities, NUL strings and arbitrary objects are stored as documented markers."""

    class Thing:
        def __repr__(self) -> str:
            return "Thing()"

    memory = oa.Memory()
    value = {"b": b"\x00\xff", "nan": math.nan, "inf": -math.inf, "s": "a\x00b", "o": Thing()}
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        memory["k"] = value
        memory.lookup("k")
    after = captured.of_type("memory_write")[0].payload["after"]
    assert after["b"] == {"$agentcap.bytes": "AP8="}
    assert after["nan"] == {"$agentcap.float": "NaN"}
    assert after["inf"] == {"$agentcap.float": "-Infinity"}
    assert after["s"] == {"$agentcap.str": "YQBi"}
    assert after["o"]["$agentcap.repr"] == "Thing()"
    assert after["o"]["type"].endswith("Thing")
    assert captured.of_type("memory_read")[0].payload["value"] == after
    kept = memory.snapshot()["k"]
    assert kept is not value and kept["b"] == value["b"] and kept["s"] == value["s"]
    assert math.isnan(kept["nan"]) and kept["inf"] == -math.inf
    assert isinstance(kept["o"], Thing) and kept["o"] is not value["o"]


def test_a_value_over_the_payload_limit_keeps_the_rest_of_the_event_readable():
    """A value over the payload size limit becomes a truncation marker in its own field; the
    memory, the key, the operation, the found flags and the other value stay as they are, so the
    key's chain still reads (which write, from what state to what state)."""
    memory = oa.Memory("notes")
    huge = "z" * (jsonsafe.DEFAULT_MAX_PAYLOAD_CHARS + 10)
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        memory["k"] = {"small": 1}
        memory["k"] = huge
        memory["k"] = 2
        memory.lookup("k")
        memory["k"] = huge
        memory.lookup("k")
    writes = captured.of_type("memory_write")
    assert [w.payload["memory"] for w in writes] == ["notes"] * 4
    assert [w.payload["key"] for w in writes] == ["k"] * 4
    assert [w.payload["op"] for w in writes] == ["set"] * 4
    assert [(w.payload["before_found"], w.payload["after_found"]) for w in writes] == [
        (False, True),
        (True, True),
        (True, True),
        (True, True),
    ]
    second, third = writes[1].payload, writes[2].payload
    assert second["before"] == {"small": 1}
    assert second["after"]["$agentcap.truncated"].startswith('"zzz')
    assert second["after"]["size"] == len(huge) + 2
    assert third["before"] == second["after"] and third["after"] == 2
    _replay_chain(writes)
    reads = captured.of_type("memory_read")
    assert [(r.payload["key"], r.payload["found"]) for r in reads] == [("k", True)] * 2
    assert reads[0].payload["value"] == 2
    assert reads[1].payload["value"] == second["after"]
    assert reads[1].payload["written_by"] == writes[3].event_id


def test_payload_fixed_at_write_time():
    """Mutating a stored object after the write does not change what the write event says."""
    memory = oa.Memory()
    stored = {"n": 1}
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        memory["k"] = stored
        stored["n"] = 2
    assert captured.of_type("memory_write")[0].payload["after"] == {"n": 1}


def test_memory_outside_agent_works_and_records_nothing():
    """Outside any agent memory reads and writes work and capture nothing."""
    memory = oa.Memory()
    with capture_events() as captured:
        memory["k"] = 1
        assert memory["k"] == 1
        assert memory.delete("k") is True
    assert captured.spans == []


def test_invalid_keys_rejected():
    """Empty, NUL-containing and non-string keys raise at the call."""
    memory = oa.Memory()
    with pytest.raises(ValueError):
        memory[""] = 1
    with pytest.raises(ValueError):
        memory["a\x00"] = 1
    with pytest.raises(TypeError):
        memory[3] = 1  # type: ignore[index]
    assert 3 not in memory


def test_untracked_write_breaks_the_chain_instead_of_lying():
    """A write outside any agent is not recorded; the next recorded write does not claim to
    follow the last recorded one, whose after value is stale."""
    memory = oa.Memory("chain-gap")
    with capture_events() as captured:
        with oa.run("run-gap"), oa.agent("a"):
            first = memory.set("k", 1)
        memory["k"] = 2  # outside any agent
        with oa.run("run-gap", resume=True), oa.agent("a"):
            memory.set("k", 3)
    writes = captured.of_type("memory_write")
    assert len(writes) == 2
    assert writes[1].payload["before"] == 2
    assert first is not None and first.event_id not in writes[1].causal_parent_ids


def test_a_value_mutated_after_it_was_stored_is_not_changed_in_memory():
    """The memory keeps its own copy: changing the object after storing it changes neither the
    memory nor the next write's before, which stays what the last write recorded as after."""
    memory = oa.Memory()
    value = {"items": [1]}
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        memory["k"] = value
        value["items"].append(2)  # behind the log's back
        assert memory["k"] == {"items": [1]}
        memory["k"] = {"items": [3]}
    first, second = captured.of_type("memory_write")
    assert second.payload["before"] == first.payload["after"] == {"items": [1]}


def test_a_read_value_mutated_by_its_reader_changes_nothing_else():
    """A value read from memory is the reader's own: another agent mutating it in place changes
    neither what others read nor the next write's before."""
    memory = oa.Memory()
    with capture_events() as captured, oa.run(_run_id()):
        with oa.agent("writer"):
            memory["k"] = {"items": [1]}
        with oa.agent("mutator"):
            memory["k"]["items"].append(2)
            memory.get("k")["items"].clear()
            memory.lookup("k").value["items"].append(9)
            memory.snapshot()["k"]["items"].append(9)
        with oa.agent("reader"):
            assert memory["k"] == {"items": [1]}
        with oa.agent("writer"):
            memory["k"] = "replaced"
    writes = captured.of_type("memory_write")
    assert writes[-1].payload["before"] == {"items": [1]}
    assert _replay_chain(writes).payload["after"] == "replaced"


def test_compare_and_set_writes_only_at_the_expected_version():
    """compare_and_set writes (and records) only when the key is at the version a lookup
    reported; versions never repeat, also across a delete."""
    memory = oa.Memory()
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        assert memory.lookup("k").version == 0
        assert memory.compare_and_set("k", 0, "first")
        first = memory.lookup("k").version
        assert memory.compare_and_set("k", 0, "stale") is False
        assert memory.compare_and_set("k", first, oa.MISSING)
        deleted = memory.lookup("k")
        assert not deleted.found and deleted.version > first
        assert memory.compare_and_set("k", first, "stale again") is False
        assert memory.compare_and_set("k", deleted.version, "second")
    assert [w.payload["op"] for w in captured.of_type("memory_write")] == ["set", "delete", "set"]


def test_concurrent_compare_and_set_increments_lose_nothing():
    """8 threads incrementing one key with compare-and-set: every increment lands once."""
    memory = oa.Memory()

    def increment() -> None:
        with oa.agent(f"w-{threading.get_ident()}"):
            for _ in range(50):
                while True:
                    seen = memory.lookup("n")
                    if memory.compare_and_set("n", seen.version, (seen.value or 0) + 1):
                        break

    with capture_events() as captured, oa.run(_run_id()):
        threads = [oa.start_thread(increment) for _ in range(8)]
        for thread in threads:
            thread.join()
    assert memory.snapshot()["n"] == 400
    assert _replay_chain(captured.of_type("memory_write")).payload["after"] == 400


def test_a_recorder_captures_a_store_of_ones_own_with_the_causal_rules():
    """MemoryRecorder records reads and writes of a plain dict used as a store: each write names
    the key's previous write, a read names the write it saw (also one passed explicitly, as a
    reference kept in the store by another process) and comes after it."""
    store: dict[str, object] = {}
    recorder = oa.MemoryRecorder("kv")
    with capture_events() as captured, oa.run(_run_id()):
        with oa.agent("writer"):
            for value in (1, 2):
                with recorder.lock("k"):
                    before = store.get("k", oa.MISSING)
                    store["k"] = value
                    ref = recorder.record_write("k", before=before, after=value)
            assert ref is not None
            store["k-ref"] = list(ref)  # what a process would store next to the value
        with oa.agent("reader"):
            recorder.record_read("k", store["k"])
            other = oa.MemoryRecorder("kv")  # knows nothing: the reference comes from the store
            other.record_read("k", store["k"], written_by=oa.EventRef(*store["k-ref"]))  # type: ignore[misc]
            recorder.record_read("missing")
    first, second = captured.of_type("memory_write")
    assert second.causal_parent_ids == (first.event_id,)
    assert (second.payload["before"], second.payload["after"]) == (1, 2)
    reads = captured.of_type("memory_read")
    assert [r.causal_parent_ids for r in reads] == [(second.event_id,), (second.event_id,), ()]
    assert all(r.seq > second.seq for r in reads)
    assert reads[2].payload["found"] is False


def test_a_write_reference_kept_as_json_links_the_read_of_another_process_to_the_write():
    """EventRef.to_list survives JSON (list(ref) holds a SpanContext, which JSON cannot encode),
    and a read recorded with EventRef.from_list of it, by a recorder that never saw the write (as
    in another process), names the write as parent and links to the write's span."""
    store: dict[str, object] = {}
    with capture_events() as captured, oa.run(_run_id()):
        with oa.agent("A"):
            writer = oa.MemoryRecorder("kv")
            with writer.lock("k"):
                store["k"] = 1
                ref = writer.record_write("k", before=oa.MISSING, after=1)
            assert ref is not None
            store["k:written_by"] = json.dumps(ref.to_list())
        with oa.agent("B"):
            written_by = oa.EventRef.from_list(json.loads(str(store["k:written_by"])))
            assert written_by[:3] == ref[:3]
            oa.MemoryRecorder("kv").record_read("k", store["k"], written_by=written_by)
    (write,) = [s for s in captured.spans if s.name == "memory_write"]
    (read,) = [s for s in captured.spans if s.name == "memory_read"]
    assert read.attributes[attr.EVENT_CAUSAL_PARENT_IDS] == (ref.event_id,)
    assert [(link.context.span_id, link.attributes[attr.LINK_EVENT_ID]) for link in read.links] == [
        (write.context.span_id, ref.event_id)
    ]


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from(["set", "set-none", "delete", "read", "read"]),
        st.sampled_from(["k", "j"]),
    ),
    max_size=30,
)


@settings(max_examples=80, deadline=None)
@given(_OPS)
def test_every_read_names_the_write_whose_outcome_it_saw(ops):
    """Over any program of sets, stored Nones, deletes and reads by several agents, a read names
    the key's last write (a delete too) as its causal parent, with a larger sequence, and finds
    what that write left (missing after a delete, None after a stored None)."""
    memory = oa.Memory("prop")
    last: dict[str, oa.EventRef] = {}
    deletes: set[str] = set()
    with capture_events() as captured, oa.run(_run_id()):
        for i, (agent, op, key) in enumerate(ops):
            with oa.agent(agent):
                if op == "read":
                    seen = memory.lookup(key)
                    expected = last.get(key)
                    assert (seen.written_by and seen.written_by[:3]) == (expected and expected[:3])
                elif op == "delete":
                    if memory.delete(key):
                        (delete,) = [
                            e
                            for e in captured.of_type("memory_write")
                            if e.payload["op"] == "delete" and e.event_id not in deletes
                        ]
                        deletes.add(delete.event_id)
                        last[key] = oa.EventRef(delete.event_id, delete.seq, delete.agent_id)
                else:
                    written = memory.set(key, None if op == "set-none" else i)
                    assert written is not None
                    last[key] = written
    writes = {e.event_id: e for e in captured.of_type("memory_write")}
    for read in captured.of_type("memory_read"):
        parents = [writes[p] for p in read.causal_parent_ids if p in writes]
        key = read.payload["key"]
        if not parents:  # the key was never written (lookup's written_by said so above)
            assert read.payload["found"] is False and "written_by" not in read.payload
            continue
        (parent,) = parents
        assert parent.payload["key"] == key and parent.seq < read.seq
        assert read.payload["written_by"] == parent.event_id
        assert read.payload["found"] is parent.payload["after_found"]
        if read.payload["found"]:
            assert read.payload["value"] == parent.payload["after"]


def test_a_read_after_a_delete_in_another_agent_follows_the_delete():
    """A read that finds a key missing because another agent deleted it names the delete as its
    causal parent, and its sequence is above the delete's."""
    memory = oa.Memory()
    with capture_events() as captured, oa.run(_run_id()):
        with oa.agent("writer"):
            for i in range(5):
                memory["k"] = i
            deleted = memory.delete("k")
        with oa.agent("reader"):
            seen = memory.lookup("k")
    assert deleted is True
    delete = captured.of_type("memory_write")[-1]
    (read,) = captured.of_type("memory_read")
    assert seen.found is False and seen.written_by is not None
    assert seen.written_by.event_id == delete.event_id
    assert read.causal_parent_ids == (delete.event_id,)
    assert read.seq > delete.seq
    assert read.payload == {
        "memory": "memory",
        "key": "k",
        "found": False,
        "written_by": delete.event_id,
    }


def test_a_write_whose_value_is_still_being_copied_when_its_agent_times_out_is_refused():
    """A write whose value takes longer to copy than its agent has left (a user __deepcopy__)
    neither changes the memory nor records a memory_write after the agent_error: the timed-out
    thread gets AgentCancelled."""
    memory = oa.Memory("late-copy")
    release = threading.Event()
    outcome: list[BaseException | None] = []

    class SlowToCopy:
        def __deepcopy__(self, memo: dict[int, object]) -> SlowToCopy:
            release.wait(10)
            return SlowToCopy()

    def body() -> None:
        try:
            memory.set("k", SlowToCopy())
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    with capture_events() as captured, oa.run(_run_id()):
        agent = oa.agent("slow-writer").agent
        with pytest.raises(oa.AgentTimeoutError):
            agent.run(body, timeout=0.05)
        release.set()
        for thread in threading.enumerate():  # the worker, if it got to run at all
            if thread.name == "agent-slow-writer":
                thread.join(10)
    # The body got AgentCancelled (or, on a machine too slow to start it in time, never ran).
    assert all(isinstance(error, oa.AgentCancelled) for error in outcome)
    assert "k" not in memory.snapshot()
    assert captured.of_type("memory_write") == []
    assert [e.event_type for e in captured.for_agent("slow-writer")] == [
        "agent_start",
        "agent_error",
    ]


class _InterruptsOnce:
    """A value whose first repr (as the payload encoder asks for it) raises KeyboardInterrupt,
    as a Ctrl-C that arrives while a write's payload is encoded."""

    armed = True

    def __repr__(self) -> str:
        if _InterruptsOnce.armed:
            _InterruptsOnce.armed = False
            raise KeyboardInterrupt
        return "_InterruptsOnce()"


@pytest.mark.fault
@pytest.mark.parametrize("store", ["memory", "recorder"])
def test_a_write_interrupted_while_its_payload_is_encoded_is_still_recorded(store):
    """A write interrupted (Ctrl-C) while its payload was encoded has happened, so its
    memory_write event is recorded too (with a marker for the values not encoded): the next write
    names an event that is in the log."""
    _InterruptsOnce.armed = True
    memory = oa.Memory("interrupted")
    recorder = oa.MemoryRecorder("interrupted")
    with capture_events() as captured, oa.run(_run_id()), oa.agent("alpha"):
        with pytest.raises(KeyboardInterrupt):
            if store == "memory":
                memory.set("k", _InterruptsOnce())
            else:
                recorder.record_write("k", before=oa.MISSING, after=_InterruptsOnce())
        if store == "memory":
            assert "k" in memory.snapshot()
            second = memory.set("k", 2)
        else:
            second = recorder.record_write("k", before=_InterruptsOnce(), after=2)
    writes = {e.event_id: e for e in captured.of_type("memory_write")}
    assert second is not None and second.event_id in writes
    (parent,) = writes[second.event_id].causal_parent_ids
    assert parent in writes
    first = writes[parent].payload
    assert first["after_found"] is True and first["after"]["$agentcap.repr"].startswith("<not")


def test_a_second_live_memory_of_one_name_is_warned_about_once(caplog):
    """Two live Memory objects of one name are two stores whose events the log cannot tell apart
    (both chains of a key start from 'missing'): the second one created logs a warning naming
    it, once per name; a name whose first object is gone is free again, and a MemoryRecorder of
    a Memory's name is warned about too."""
    name = f"notes-{uuid.uuid4().hex[:8]}"
    caplog.set_level("WARNING", logger="otel_agentcap")
    first = oa.Memory(name)
    assert not caplog.records
    second = oa.Memory(name)
    third = oa.Memory(name)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and f"a second memory named {name!r}" in warnings[0]
    caplog.clear()
    del first, second, third
    alone = oa.Memory(name)
    assert not caplog.records
    other = f"kv-{uuid.uuid4().hex[:8]}"
    kept = oa.Memory(other)
    recorder = oa.MemoryRecorder(other)
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(
        f"agentcap: a second memory named {other!r} in this process (a MemoryRecorder; the "
        "first is a Memory)"
    )
    assert alone.name == name and kept is not recorder


def test_missing_stays_itself_when_copied_or_pickled():
    """MISSING copied (a tool's recorded result is replayed as a private copy) or pickled is
    MISSING itself, so ``is MISSING`` holds for a replayed result."""
    import copy
    import pickle

    @oa.tool
    def find(key: str) -> object:
        return oa.MISSING

    assert copy.deepcopy(oa.MISSING) is oa.MISSING
    assert copy.copy(oa.MISSING) is oa.MISSING
    assert pickle.loads(pickle.dumps(oa.MISSING)) is oa.MISSING
    with oa.run(f"missing-{uuid.uuid4().hex[:8]}"), oa.agent("a"):
        assert find.invoke("once", "k") is oa.MISSING
        assert find.invoke("once", "k") is oa.MISSING  # replayed
