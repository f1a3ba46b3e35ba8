from __future__ import annotations

from typing import Optional

import typer

from specquant_cli.commands.options import CHAT_MAX_TOKENS, JsonOpt, with_settings
from specquant_cli.console import err, out, out_json, stderr_reporter
from specquant_cli.inputs import check_text, read_prompt, stdin_is_tty
from specquant_cli.settings import Settings

HELP = """Chat with a family: each prompt routed and planned, lossless unless the policy says it is lossy.

Interactive on a terminal, or with -i. Otherwise one answer to PROMPT, or to stdin when no PROMPT is given or \
PROMPT is '-' (chat "Summarize:" - < file joins them); --each-line answers every line. docs/usage.md"""

COMMANDS_HELP = "/stats  /route [TEXT]  /policy NAME  /reset  /exit   (Ctrl-C stops an answer, Ctrl-D quits)"


def register(app: typer.Typer) -> None:
    app.command("chat", help=HELP, short_help="Chat with a family, interactively or from a pipe")(chat)


SETTINGS = ("decoding.policy", "decoding.temperature", "decoding.top_p", "decoding.top_k", "decoding.seed",
            "decoding.gamma", "runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads", "runtime.mmap",
            "runtime.rpc",
            "runtime.rpc_timeout", "decoding.draft_memory")


@with_settings(*SETTINGS, "runtime.deterministic")
def chat(
    prompt: Optional[list[str]] = typer.Argument(None, help="Prompt text; '-' stands for stdin", show_default=False),
    max_tokens: int = typer.Option(CHAT_MAX_TOKENS, "--max-tokens", min=1, help="New tokens per answer"),
    system: Optional[str] = typer.Option(None, "--system", help="System message"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)"),
    json_out: bool = JsonOpt,
    each_line: bool = typer.Option(False, "--each-line", help="Each non-empty input line is its own prompt"),
    stats: bool = typer.Option(False, "--stats", help="Print generation stats to stderr"),
    interactive: bool = typer.Option(False, "--interactive", "-i", help="Interactive even when stdin is piped"),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", metavar="FILE",
                                              help="Hold every answer to this JSON Schema"),
    predict: Optional[str] = typer.Option(None, "--predict", metavar="FILE",
                                          help="A file the answer resembles (drafted from, lossless)"),
    *, cfg: Settings,
) -> None:
    from specquant_cli.decoding.sampling import SamplingParams
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings

    d = cfg.decoding
    if system is not None:
        check_text(system, "--system")
    for s in stop:
        check_text(s, "--stop")
    is_interactive = interactive or (not prompt and stdin_is_tty())
    prediction = _prediction(predict, prompt, is_interactive)
    prompts = [] if is_interactive else _prompts(prompt, each_line)
    session = open_session(SessionSettings.of(cfg, sampling=SamplingParams(d.temperature, d.top_k, d.top_p, d.seed),
                                              max_tokens=max_tokens, system=system, stop=tuple(stop)),
                           report=stderr_reporter(), warn_ctx=True)
    runtime = session.runtime
    session.prediction = prediction
    try:
        if json_schema is not None:
            from specquant_cli.decoding.grammar import schema_file

            session.grammar = schema_file(check_text(json_schema, "--json-schema"), runtime.tokenizer())
        if is_interactive:
            _interactive(session, stats)
        else:
            for text in prompts:  # single-turn each: _one does not add to the history
                _one(session, text, json_out, stats)
    finally:
        runtime.close()


MAX_PREDICTION_BYTES = 16 << 20  # a prediction is at most a context of tokens: far less than this


def _prediction(path: Optional[str], prompt: Optional[list[str]], interactive: bool) -> Optional[str]:
    """The text of --predict FILE ('-': stdin, when neither the prompt nor an interactive session reads it); None
    without --predict."""
    from specquant_cli.errors import InputError
    from specquant_cli.inputs import decode_input, read_stdin

    if path is None:
        return None
    check_text(path, "--predict")
    if path == "-":
        if interactive or not prompt or "-" in prompt:
            raise InputError("--predict - reads stdin, which the prompt reads too; give the prompt as an argument "
                             "(or the prediction as a file)")
        return read_stdin()
    from pathlib import Path

    from specquant_cli.fsutil import read_input_file

    data = read_input_file(Path(path), "--predict", "file", MAX_PREDICTION_BYTES)
    if len(data) > MAX_PREDICTION_BYTES:
        raise InputError(f"--predict {path} is larger than {MAX_PREDICTION_BYTES >> 20} MiB")
    return decode_input(data, f"--predict {path}")


def _prompts(prompt: Optional[list[str]], each_line: bool) -> list[str]:
    text = read_prompt(prompt)
    if not each_line:
        return [text]
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]  # \n only: not U+2028, form feed, ...
    if not lines:
        from specquant_cli.errors import InputError

        raise InputError("--each-line: no non-empty line in the input")
    return lines


def _stats_line(answer, predicted: bool = False) -> str:
    s = answer.last.stats()
    lossy = " [lossy]" if answer.plan.lossy else ""
    prediction = (f", prediction {s['prediction_accepted']} accepted / {s['prediction_rejected']} rejected"
                  if predicted else "")
    return (f"[{answer.route.tier} {answer.route.score:.2f} → {answer.plan.describe()}{lossy}] "
            f"{s['new_tokens']} tokens in {s['total_s']:.2f}s, {s['tokens_per_s']:.1f} tok/s, "
            f"accepted {s['accepted']}/{s['drafted']} ({s['acceptance_rate']:.0%}), "
            f"{s['mean_accepted_length']:.2f} tokens/parent call{prediction}, finish {s['finish_reason']}")


def _one(session, text: str, json_out: bool, stats: bool) -> None:
    answer, records = session.ask(text, remember=False)
    if answer.plan.lossy and not json_out:
        err.print(f"[yellow]note:[/] policy {answer.plan.policy} is lossy: {answer.plan.describe()}")
    for rec in records:
        if not json_out and rec.text:
            out(rec.text, end="")
    if json_out:
        out_json(answer.to_dict())
    else:
        out("")
    if stats:
        err.print(_stats_line(answer, bool(session.prediction)), markup=False)
    if answer.last is not None and answer.last.finish_reason == "interrupted":
        raise KeyboardInterrupt  # Ctrl-C stops the whole batch (exit 130), not just this answer
    _check_complete(session, answer)


def _check_complete(session, answer) -> None:
    """An answer held to a schema that ran out of --max-tokens (or that a --stop string cut) is no valid JSON:
    said, and the exit is 1."""
    if session.grammar is None or answer.last is None:
        return
    from specquant_cli.errors import InputError

    if answer.last.finish_reason == "length":
        raise InputError(f"the answer reached --max-tokens {session.max_tokens} before its JSON was complete; "
                         "raise --max-tokens")
    problem = session.grammar.validate(answer.text)
    if problem is not None:
        raise InputError(f"the answer is not valid for the schema ({problem[:200]}); was it cut by --stop?")


def _interactive(session, stats: bool) -> None:
    from specquant_cli import interrupts
    from specquant_cli.errors import InputError, SpecquantError
    from specquant_cli.inputs import read_line

    err.print(f"specquant chat — family {session.runtime.family.name}, policy {session.policy}. {COMMANDS_HELP}",
              markup=False)
    while True:
        if interrupts.terminated():  # SIGTERM during an answer: the answer stopped, now the session does
            raise interrupts.Terminated()
        err.print("you> ", end="", markup=False)
        try:
            line = read_line()
        except EOFError:
            err.print("")
            return
        except InputError as e:  # a mistyped byte costs the line, not the session
            err.print(f"error: {e}; line ignored", markup=False)
            continue
        except interrupts.Terminated:
            raise
        except KeyboardInterrupt:
            err.print("\n(Ctrl-D or /exit quits)")
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if _command(session, line) == "exit":
                return
            continue
        try:
            answer, records = session.ask(line)
            for rec in records:
                if rec.text:
                    out(rec.text, end="")
        except SpecquantError as e:  # e.g. the conversation outgrew the context: the session goes on
            err.print(f"error: {e} (/reset starts over)", markup=False)
            continue
        out("")
        if answer.last.finish_reason == "interrupted":
            err.print("(answer stopped)")
        if stats:
            err.print(_stats_line(answer, bool(session.prediction)), markup=False)


def _command(session, line: str) -> Optional[str]:
    from specquant_cli.errors import SpecquantError

    cmd, _, arg = line.partition(" ")
    arg = arg.strip()
    if cmd in ("/exit", "/quit"):
        return "exit"
    if cmd == "/reset":
        session.reset()
        err.print("history cleared")
    elif cmd == "/stats":
        err.print(_stats_line(session.last, bool(session.prediction)) if session.last else "no answer yet",
                  markup=False)
    elif cmd == "/route":
        text = arg or (session.last.prompt if session.last else "")
        if not text:
            err.print("usage: /route TEXT (or ask something first)")
            return None
        route, plan = session.plan(text)
        err.print(f"tier {route.tier}, score {route.score:.3f}, plan {plan.describe()}; features {route.features}",
                  markup=False)
    elif cmd == "/policy":
        try:
            session.set_policy(arg)
            err.print(f"policy {arg}")
        except SpecquantError as e:
            err.print(f"error: {e}", markup=False)
    else:
        err.print(f"unknown command {cmd}; {COMMANDS_HELP}", markup=False)
    return None
