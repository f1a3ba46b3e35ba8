"""The deterministic mode (`--deterministic`, backend.context's uniform contexts) on the small family with real
llama.cpp contexts: every way one request can compute a row gives the same bits as one token at a time (`bench
logits`: verification batches, a restored prefix, other prefill chunks, other threads, another slot decoding between
its calls), a greedy answer is the same bytes under every policy, with the prompt cache cold or warm, with a
prediction that holds and one that does not, and at max_tokens N and N+1; and through a real server with four slots,
a request gets the bytes it gets alone while the others decode (greedy under every policy, and seeded sampling)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import KEY, ServerProc

from conftest import run_cli


@pytest.mark.slow
def test_every_way_of_computing_a_row_is_bit_equal_in_the_deterministic_mode(family_dir, tmp_path):
    out = tmp_path / "logits.json"
    r = run_cli(["bench", "logits", "--family", str(family_dir), "--positions", "24", "--deterministic",
                 "--json-file", str(out)])
    assert r.exit_code == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["stamp"]["mode"] == "deterministic"  # the report says the mode its rows were computed in
    [(_, rep)] = report["models"].items()
    assert "beside a slot" in {c["case"] for c in rep["cases"]}
    for c in rep["cases"]:
        assert c["rows"] and c["bit_equal"] == c["rows"] and c["max_diff"] == 0.0, c


ASK = "Write a long story about a lighthouse keeper, a storm and a ship."
N = 40


@pytest.fixture(scope="module")
def session(family_dir):
    """A session opened in the deterministic mode (as `--deterministic` sets it at the command edge)."""
    from specquant_cli.decoding.sampling import SamplingParams
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings, environment, resolve

    mp = pytest.MonkeyPatch()
    mp.setattr(environment, "_resolved_deterministic", [True])
    mp.setenv("SPECQUANT_DETERMINISTIC", "1")
    given = {"runtime.family": family_dir, "runtime.threads": 1, "runtime.ctx": 1024}
    cfg = resolve(list(given), given)
    s = open_session(SessionSettings.of(cfg, sampling=SamplingParams(), max_tokens=N))
    try:
        yield s
    finally:
        s.runtime.close()
        mp.undo()


def _text(session, policy, n=N, prediction=None):
    import uuid

    from specquant_cli.decoding.sampling import GREEDY

    answer, records = session.ask_messages([{"role": "user", "content": ASK}], policy=policy, sampling=GREEDY,
                                           max_tokens=n, prediction=session.prediction_tokens(prediction),
                                           scope=uuid.uuid4().hex)
    return "".join(rec.text for rec in records)


@pytest.mark.slow
def test_a_greedy_answer_is_the_same_bytes_under_every_policy_cache_state_and_length(session):
    parent = session.runtime.family.parent_rendering
    assert session.runtime.pool.context(parent).uniform  # contexts made in the mode the session was opened in
    cold = _text(session, "parent")
    assert cold and _text(session, "parent") == cold  # the prompt's cache warm now
    for policy in ("spec-q4", "suffix", "auto"):
        assert _text(session, policy) == cold, policy
    assert _text(session, "auto", prediction=cold) == cold  # drafted from a prediction that holds
    assert _text(session, "auto", prediction=cold[::-1]) == cold  # and from one that does not
    longer = _text(session, "parent", N + 1)
    assert longer.startswith(cold) and len(longer) > len(cold)


def test_in_the_deterministic_mode_no_divergence_is_a_near_tie():
    """The judge's near-tie is batch-vs-single noise; the mode has none, so any divergence there is a failure."""
    from types import SimpleNamespace

    from specquant_cli.bench.fidelity import NEAR_TIE, UNEXPLAINED, _verdict

    assert _verdict(SimpleNamespace(uniform=False), True) == {"verdict": NEAR_TIE}
    assert _verdict(SimpleNamespace(uniform=False), False) == {"verdict": UNEXPLAINED}
    assert _verdict(SimpleNamespace(uniform=True), True) == {"verdict": UNEXPLAINED, "mode": "deterministic"}


SYSTEM = "You are the archivist of a small coastal museum. Answer in full sentences. " * 10
QUESTIONS = ("Which ship is the oldest?", "When does the museum open?", "Who founded the museum?",
             "What is in the cellar?")
SLOT_POLICIES = ("parent", "spec-q4", "suffix", "auto")


@pytest.mark.slow
def test_four_slots_give_each_request_the_bytes_it_gets_alone(family_dir):
    """Each slot a cache of its own (runtime.pool.ModelPool.own_caches): a request decoding while three others do, and
    a system prompt copied from another slot's cells, change no bit of an answer."""
    s = ServerProc(["--family", str(family_dir), "--parallel", "4", "--deterministic", "--policy", "parent",
                    "--policies", ",".join(SLOT_POLICIES), "--api-key", KEY, "--cache-ram", "64"])
    try:
        assert {kv["sequences"] for kv in s.health()["kv"].values()} == {4}

        def ask(q: str, policy: str = "parent", n: int = N, **sampling) -> str:
            r = s.client().chat.completions.create(
                model="m", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                max_tokens=n, extra_body={"specquant_policy": policy}, **({"temperature": 0} | sampling))
            return r.choices[0].message.content

        alone = [ask(q) for q in QUESTIONS]  # one at a time: the later ones copy the system prompt from a slot
        assert s.health()["prompt_cache"]["copied_tokens"] > 100
        seeded = ask(QUESTIONS[0], temperature=0.9, seed=11)
        with ThreadPoolExecutor(5) as pool:
            for _ in range(2):  # with the slots' caches cold, then holding the last round's answers
                jobs = [pool.submit(ask, q, p) for q, p in zip(QUESTIONS, SLOT_POLICIES)]
                sampled = pool.submit(ask, QUESTIONS[0], "parent", N, temperature=0.9, seed=11)
                assert [j.result() for j in jobs] == alone
                assert sampled.result() == seeded
            longer = [pool.submit(ask, q, p, N + 1) for q, p in zip(QUESTIONS, reversed(SLOT_POLICIES))]
            for got, want in zip(longer, alone):
                assert got.result().startswith(want)
    finally:
        s.stop()


def test_in_the_deterministic_mode_verdicts_are_identical_or_differing():
    """Reports of answers judged in the deterministic mode count identical and differing only (no near-tie excuse)."""
    from specquant_cli.bench import fidelity, report, sides

    exact = {"identical": 7, "near_tie": 0, "unexplained": 1, "exact": True}
    noisy = {"identical": 5, "near_tie": 2, "unexplained": 1}
    assert fidelity.cell(exact) == "7/1" and fidelity.cell(noisy) == "5/2/1" and fidelity.cell(None) == "–"
    assert "ident/differ" in [c.header for c in report.columns([{"fidelity": exact}])]
    assert "ident/tie/unexpl" in [c.header for c in report.columns([{"fidelity": noisy}])]
    summed = sides._summed([exact, exact])
    assert summed["exact"] and summed["identical"] == 14 and fidelity.shown(summed) == [("identical", 14),
                                                                                       ("differing", 2)]


@pytest.mark.slow
def test_a_prefix_restored_from_the_prompt_cache_in_ram_or_on_disk_gives_the_same_bytes(family_dir, tmp_path):
    """One slot: a conversation's state goes to the prompt cache when the slot serves another, and comes back from
    RAM, then in a later server from --cache-dir; each answer is the bytes of a server with no prompt cache."""
    def ask(s: ServerProc, system: str, policy: str = "parent") -> str:
        r = s.client().chat.completions.create(
            model="m", messages=[{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}],
            max_tokens=N, temperature=0, extra_body={"specquant_policy": policy})
        return r.choices[0].message.content

    other = "You are a lighthouse keeper's logbook. Answer in the voice of the log. " * 10
    base = ["--family", str(family_dir), "--parallel", "1", "--deterministic", "--policy", "parent",
            "--policies", "parent,suffix", "--api-key", KEY]
    s = ServerProc([*base, "--no-prompt-cache"])
    try:
        want = ask(s, SYSTEM)
    finally:
        s.stop()
    s = ServerProc([*base, "--cache-ram", "64", "--cache-dir", str(tmp_path / "cache")])
    try:
        assert ask(s, SYSTEM) == want
        ask(s, other)  # the slot serves another prompt: the first one's state goes to the cache
        assert ask(s, SYSTEM, "suffix") == want and s.health()["prompt_cache"]["hits"] >= 1
    finally:
        s.stop()
    s = ServerProc([*base, "--cache-ram", "64", "--cache-dir", str(tmp_path / "cache")])
    try:
        assert ask(s, SYSTEM) == want and s.health()["prompt_cache"]["hits"] >= 1  # from the folder
    finally:
        s.stop()
