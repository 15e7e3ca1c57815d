"""Run by tests/test_anthropic_oldest_sdk.py with anthropic 0.40 first on sys.path; prints JSON."""
# ruff: noqa: E402

import asyncio
import gc
import json

import anthropic

assert anthropic.__version__ == "0.40.0", anthropic.__version__
import otel_agentcap as ac
from otel_agentcap.capture.tool_uses import run_tool_uses
from otel_agentcap.instrumentation.anthropic import AnthropicInstrumentor, sdk_traces_itself
from otel_agentcap.testing import capture_events
from otel_agentcap.testing.messages_server import (
    MessagesServer,
    ToolCall,
    error_reply,
    text_reply,
    tool_use_reply,
)

assert not sdk_traces_itself()


@ac.tool
def lookup(q: str) -> str:
    return f"result for {q}"


out = {}
with capture_events() as cap, MessagesServer() as server:
    AnthropicInstrumentor().instrument()
    client = anthropic.Anthropic(base_url=server.base_url, api_key="sk-old-SECRET", max_retries=0)
    aclient = anthropic.AsyncAnthropic(
        base_url=server.base_url, api_key="sk-old-SECRET", max_retries=0
    )
    kw = dict(model="claude-x", max_tokens=100)
    # Outside any agent (no events): the proxies offer the SDK object's protocols and no other.
    hello = [{"role": "user", "content": "x"}]
    sync_manager = client.messages.stream(messages=hello, **kw)
    sync_stream = client.messages.create(messages=hello, stream=True, **kw)
    protocols = {
        "sync_manager_is_async": hasattr(sync_manager, "__aenter__"),
        "sync_stream_is_async": hasattr(sync_stream, "__aenter__"),
    }
    sync_stream.close()

    async def protocol_checks():
        async_client = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="k")
        try:
            async with sync_manager:
                pass
        except Exception as e:
            protocols["async_with_on_sync_manager"] = type(e).__name__
        async_manager = async_client.messages.stream(messages=hello, **kw)
        protocols["async_manager_is_sync"] = hasattr(async_manager, "__enter__")
        async with async_manager as stream:
            await stream.get_final_message()
        async_stream = await async_client.messages.create(messages=hello, stream=True, **kw)
        protocols["async_stream_is_sync"] = hasattr(async_stream, "__enter__")
        await async_stream.close()

    asyncio.run(protocol_checks())
    out["protocols"] = protocols
    with ac.run("old"), ac.agent("a"):
        server.enqueue(
            tool_use_reply(
                [ToolCall("lookup", {"q": "x"}, id="toolu_old")],
                input_tokens=10,
                output_tokens=7,
                cache_read=5,
            )
        )
        m = client.messages.create(messages=[{"role": "user", "content": "hi"}], **kw)
        res = run_tool_uses(m, [lookup])
        server.enqueue(text_reply("a" * 40, input_tokens=10, output_tokens=87))
        msgs = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": m.content},
            {"role": "user", "content": res},
        ]
        s = client.messages.create(messages=msgs, stream=True, **kw)
        for _ in s:
            pass
        server.enqueue(text_reply("b" * 40, output_tokens=87))
        s = client.messages.create(messages=[{"role": "user", "content": "x"}], stream=True, **kw)
        for i, _ in enumerate(s):
            if i == 3:
                break
        del s
        gc.collect()
        server.enqueue(text_reply("c" * 40, output_tokens=87))
        with client.messages.stream(messages=[{"role": "user", "content": "x"}], **kw) as ms:
            ms.get_final_message()
        server.enqueue(error_reply(529))
        try:
            client.messages.create(messages=[{"role": "user", "content": "x"}], **kw)
        except anthropic.InternalServerError as e:
            out["error_class"] = type(e).__name__

        async def amain():
            server.enqueue(text_reply("d" * 40, output_tokens=87, stream_error_after=3))
            try:
                st = await aclient.messages.create(
                    messages=[{"role": "user", "content": "x"}], stream=True, **kw
                )
                async for _ in st:
                    pass
            except anthropic.APIStatusError as e:
                out["stream_error"] = type(e).__name__
            server.enqueue(text_reply("e" * 40, output_tokens=87))
            async with aclient.messages.stream(
                messages=[{"role": "user", "content": "x"}], **kw
            ) as ms:
                await ms.get_final_message()

        asyncio.run(amain())
    with ac.run("old-raw"), ac.agent("a"):
        server.enqueue(
            tool_use_reply(
                [ToolCall("lookup", {"q": "y"}, id="toolu_raw")], input_tokens=10, output_tokens=7
            )
        )
        raw = client.messages.with_raw_response.create(
            messages=[{"role": "user", "content": "raw"}], **kw
        )
        out["raw_parsed_id"] = raw.parse().id
        out["raw_request_id"] = raw.headers.get("request-id")
raw_events = [e for e in cap.events if e.run_id == "old-raw"]
out["raw_calls"] = [e.payload for e in raw_events if e.event_type == "model_call"]
out["events"] = [
    dict(
        seq=e.seq,
        type=e.event_type,
        id=e.event_id,
        parents=list(e.causal_parent_ids),
        payload=e.payload,
    )
    for e in cap.events
    if e.run_id == "old"
]
out["spans"] = [s.name for s in cap.spans]
print(json.dumps(out))
