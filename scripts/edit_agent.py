#!/usr/bin/env python3
"""The file-editing agent behind `specquant_cli/bench/agents-bisect.trace.jsonl`: the OpenAI Agents SDK on the
Responses API, outside the test suite (the SDK is not a dependency of specquant). It reads a file with a `read_file`
function tool (`tool_choice: required` until it has called it: the SDK resets it after a call), answers with the whole
file changed in one code block, and this script writes that back; two tasks in one session, the second asked with the
first's turns before it.

    python -m venv /tmp/agents && /tmp/agents/bin/pip install openai-agents
    specquant serve --family qwen2.5-coder-1.5b --port 8080 --ctx 8192 --parallel 1 &
    specquant bench record trace.jsonl --upstream http://127.0.0.1:8080 --port 8090 &
    mkdir /tmp/work && cp CPYTHON/Lib/bisect.py /tmp/work/      # CPython 3.11's
    /tmp/agents/bin/python scripts/edit_agent.py http://127.0.0.1:8090/v1 /tmp/work
    kill -INT %2

Arguments: the server's base URL (with /v1) and the folder holding bisect.py."""

import re
import sys
from pathlib import Path

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

TASKS = ("In bisect.py, rename the parameter lo to low everywhere.",
         "In bisect.py, rename the parameter hi to high everywhere.")
INSTRUCTIONS = ("You edit Python files. First call read_file on the file the user names. When you have its text, "
                "reply with the whole file as it reads after the change: every line of it, changed or not, in one "
                "```python code block.")


def main(base: str, work: Path) -> None:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base, api_key="local")

    @function_tool
    def read_file(path: str) -> str:
        """Return the whole text of the file at `path`."""
        named = work / Path(path).name
        return (named if named.is_file() else work / "bisect.py").read_text()  # the workspace holds one file

    agent = Agent(name="editor", model=OpenAIResponsesModel(model="qwen2.5-coder-1.5b", openai_client=client),
                  instructions=INSTRUCTIONS, tools=[read_file], model_settings=ModelSettings(tool_choice="required"))
    history: list = []
    for task in TASKS:
        r = Runner.run_sync(agent, [*history, {"role": "user", "content": task}], max_turns=4)
        history = r.to_input_list()
        m = re.search(r"```(?:python)?\n(.*?)```", str(r.final_output), re.S)
        if m:
            (work / "bisect.py").write_text(m.group(1))
        print(task, "->", "file written" if m else str(r.final_output)[:200], file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: edit_agent.py BASE_URL FOLDER")
    main(sys.argv[1], Path(sys.argv[2]))
