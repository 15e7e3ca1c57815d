"""Run by tests/test_distro.py under opentelemetry-instrument: an app with no telemetry setup of
its own. A model call asks for a tool, the tool runs, the next call sends the result back."""

import os
import sys

import anthropic

import otel_agentcap as ac


@ac.tool
def weather(city: str) -> str:
    return f"sunny in {city}"


def main() -> None:
    client = anthropic.Anthropic(base_url=os.environ["APP_BASE_URL"], api_key="test", max_retries=0)
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Weather?"}]
    with ac.run(sys.argv[1]), ac.agent("assistant"):
        first = client.messages.create(model="m", max_tokens=64, messages=messages)
        results = ac.run_tool_uses(first, [weather])
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": results},
        ]
        client.messages.create(model="m", max_tokens=64, messages=messages)
    print("app done")


if __name__ == "__main__":
    main()
