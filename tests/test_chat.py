import json

import pytest

from conftest import run_cli

N = "12"  # max tokens: keeps the suite fast on the 135M family


def chat(args, input=None):
    return run_cli(["chat", "--max-tokens", N, *args], input=input)


def test_argument_only(family_dir):
    r = chat(["What is the capital of France?", "--family", str(family_dir)])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() and r.stdout.endswith("\n")


def test_stdin_only_equals_argument_only(family_dir):
    a = chat(["Name a color.", "--family", str(family_dir)])
    b = chat(["--family", str(family_dir)], input="Name a color.\n")
    assert a.exit_code == b.exit_code == 0 and a.stdout == b.stdout


def test_argument_and_dash_are_joined(family_dir):
    r = chat(["Summarize this text:", "-", "--family", str(family_dir), "--json"], input="The cat sat on the mat.\n")
    d = json.loads(r.stdout)
    assert d["prompt"] == "Summarize this text:\n\nThe cat sat on the mat."


def test_a_prompt_argument_never_reads_stdin(family_dir):
    """The stdin rule: with PROMPT given (and no '-'), stdin is left alone, so a `while read` loop works."""
    r = chat(["Say hi.", "--family", str(family_dir), "--json"], input="this must stay unread\n")
    assert json.loads(r.stdout)["prompt"] == "Say hi."


def test_dash_reads_stdin(family_dir):
    r = chat(["-", "--family", str(family_dir), "--json"], input="Hello\n")
    assert json.loads(r.stdout)["prompt"] == "Hello"


def test_json_shape(family_dir):
    r = chat(["Why is the sky blue?", "--family", str(family_dir), "--json", "--policy", "spec-q4"])
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    d = json.loads(lines[0])
    assert set(d) == {"prompt", "route", "text", "finish_reason", "stats"}
    assert set(d["route"]) >= {"tier", "score", "features", "policy"} and d["route"]["policy"] == "spec-q4"
    assert set(d["stats"]) >= {"prompt_tokens", "new_tokens", "drafted", "accepted", "acceptance_rate",
                               "mean_accepted_length", "parent_calls", "draft_s", "verify_s", "total_s",
                               "tokens_per_s", "finish_reason"}
    assert d["finish_reason"] in ("stop", "length") and d["stats"]["drafted"] > 0


def test_each_line_is_its_own_prompt(family_dir):
    r = chat(["--family", str(family_dir), "--each-line", "--json"], input="Hi\n\nName a fruit.\n  \nCount to 3.\n")
    rows = [json.loads(ln) for ln in r.stdout.strip().splitlines()]
    assert [x["prompt"] for x in rows] == ["Hi", "Name a fruit.", "Count to 3."]


def test_stats_go_to_stderr_only(family_dir):
    r = chat(["Hello", "--family", str(family_dir), "--stats"])
    assert "tok/s" in r.stderr and "tok/s" not in r.stdout


def test_lossy_policy_is_labelled(family_dir):
    r = chat(["Hello", "--family", str(family_dir), "--policy", "q4", "--stats"])
    assert r.exit_code == 0 and "lossy" in r.stderr
    d = json.loads(chat(["Hello", "--family", str(family_dir), "--policy", "quasar", "--json"]).stdout)
    assert d["route"]["lossy"] is True


@pytest.mark.parametrize("args,input,needle", [
    ([], "", "empty prompt"),
    ([], "   \n\n", "empty prompt"),
    ([], b"caf\xe9 au lait\n", "not valid UTF-8 (byte 0xe9 at offset 3)"),
    (["--policy", "fastest"], "hi", "unknown policy 'fastest'"),
    (["--max-tokens", "100", "--ctx", "256"], "word " * 400, "exceeds the context size"),
])
def test_bad_input_is_one_line(family_dir, args, input, needle):
    r = run_cli(["chat", "--family", str(family_dir), *args], input=input)
    assert r.exit_code == 1, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert r.stdout == ""


def test_missing_default_family_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run_cli(["chat", "hello"])
    assert r.exit_code == 1 and "specquant pull smollm2-135m" in r.stderr


def test_interactive_commands(family_dir):
    session = "\n".join([
        "/policy parent", "Name a color.", "/stats", "/route", "/policy nonsense", "/route Tell me more.",
        "/reset", "/bogus", "Name an animal.", "/exit", "never read",
    ]) + "\n"
    r = run_cli(["chat", "-i", "--family", str(family_dir), "--max-tokens", "8"], input=session)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.count("\n") == 2  # two answers, one line each (8 tokens)
    err = r.stderr
    assert "policy parent" in err and "tokens/parent call" in err and "tier low" in err
    assert "unknown policy 'nonsense'" in err and "history cleared" in err and "unknown command /bogus" in err


def test_interactive_keeps_history(family_dir):
    from specquant_cli.family.manifest import Family
    from specquant_cli.routing.router import Router
    from specquant_cli.runtime import Runtime
    from specquant_cli.session import ChatSession

    rt = Runtime.open(Family.load(family_dir), n_ctx=1024)
    s = ChatSession(rt, Router(), "parent", max_tokens=6)
    for text in ("My name is Ada.", "What is my name?"):
        _, recs = s.ask(text)
        list(recs)
    assert [m["role"] for m in s.history] == ["user", "assistant", "user", "assistant"]
    assert s.messages("x")[0]["content"] == "My name is Ada."
    s.reset()
    assert s.history == []
    rt.close()


PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Explain recursion briefly.",
           "List three uses of copper.", "Because the train was late, we missed the concert that we had "
           "planned to attend in Vienna with Maria and Thomas; what could we have done differently?"]


def test_lossless_policies_equal_parent_greedy(family_dir):
    def answers(policy):
        r = run_cli(["chat", "--family", str(family_dir), "--each-line", "--json", "--max-tokens", "24",
                     "--policy", policy], input="\n".join(PROMPTS) + "\n")
        assert r.exit_code == 0, r.stderr
        return [json.loads(ln) for ln in r.stdout.strip().splitlines()]

    want = [a["text"] for a in answers("parent")]
    tiers = set()
    for policy in ("paper", "spec-q4", "spec-q8", "ngram", "adaptive"):
        got = answers(policy)
        assert [a["text"] for a in got] == want, policy
        tiers |= {a["route"]["tier"] for a in got}
    assert {"low", "high"} <= tiers
