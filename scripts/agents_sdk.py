#!/usr/bin/env python3
"""The OpenAI Agents SDK against `specquant serve`'s Responses endpoint: an optional check, outside the test suite
(the SDK is not a dependency of specquant).

    python -m venv /tmp/agents && /tmp/agents/bin/pip install openai-agents
    /tmp/agents/bin/python scripts/agents_sdk.py --family models/smollm2-135m

starts `.venv/bin/specquant serve --threads 1` on the family (arguments after `--` go to it; or uses `--url` of a
running server, `--api-key` its key) and runs,
with the SDK's OpenAIResponsesModel, greedy: a function-tool round trip (the model must call the tool, the SDK runs it
and sends its output back, the model answers in text), the same streamed (Runner.run_streamed), and a structured
output (`output_type`, a strict json_schema). Each flow prints one line; the exit is 1 when any fails."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEY = "agents-sdk-check"


def start_server(family: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """`specquant serve --port 0` on `family`; its URL once it listens (its stderr goes on to ours)."""
    proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "specquant"), "serve", "--family", family, "--port", "0",
                             "--api-key", KEY, *(extra or ["--threads", "1"])], cwd=REPO, stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            sys.stderr.write(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(300) or not found:
        proc.terminate()
        raise SystemExit("agents_sdk.py: the server did not start")
    return proc, found[0]


async def flows(url: str, key: str) -> list[tuple[str, bool, str]]:
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)
    model = OpenAIResponsesModel(model="specquant", openai_client=client)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny and 21 degrees in {city}."

    settings = ModelSettings(tool_choice="required", temperature=0, max_tokens=96)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model,
                  model_settings=settings)
    out: list[tuple[str, bool, str]] = []

    async def flow(name: str, run) -> None:
        calls.clear()
        try:
            ok, detail = await run()
        except Exception as e:  # noqa: BLE001 - each flow's failure is reported, the others still run
            ok, detail = False, f"{type(e).__name__}: {e}"
        out.append((name, ok, detail))

    async def round_trip():
        r = await Runner.run(agent, "What's the weather in Paris?", max_turns=4)
        return bool(calls) and isinstance(r.final_output, str), f"tool called with {calls}, answer {r.final_output!r}"

    async def streamed():
        r = Runner.run_streamed(agent, "What's the weather in Paris?", max_turns=4)
        kinds = set()
        async for event in r.stream_events():
            kinds.add(event.type)
        return bool(calls) and isinstance(r.final_output, str), \
            f"tool called with {calls}, answer {r.final_output!r}, events {sorted(kinds)}"

    class City(BaseModel):
        name: str
        country: str

    async def structured():
        typed = Agent(name="city", instructions="Name a city.", model=model, output_type=City,
                      model_settings=ModelSettings(temperature=0, max_tokens=64))
        r = await Runner.run(typed, "Name the capital of France.", max_turns=1)
        return isinstance(r.final_output, City), f"output {r.final_output!r}"

    await flow("function-tool round trip", round_trip)
    await flow("function-tool round trip, streamed", streamed)
    await flow("structured output (output_type)", structured)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default=str(REPO / "models" / "smollm2-135m"))
    ap.add_argument("--url", help="a running server (default: start one on --family)")
    ap.add_argument("--api-key", default=os.environ.get("SPECQUANT_API_KEY", KEY))
    ap.add_argument("serve_args", nargs="*", help="after --: arguments for specquant serve (default: --threads 1)")
    args = ap.parse_args()
    try:
        import agents  # noqa: F401
    except ImportError:
        print("agents_sdk.py: the openai-agents package is not installed in this Python", file=sys.stderr)
        return 2
    proc, url = (None, args.url) if args.url else start_server(args.family, args.serve_args)
    key = args.api_key if args.url else KEY
    t0 = time.perf_counter()
    try:
        results = asyncio.run(flows(url, key))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    for name, ok, detail in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    passed = sum(ok for _, ok, _ in results)
    print(f"{passed}/{len(results)} flows in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
