"""`specquant serve --parallel 4` for real: concurrent `openai` clients decode together, each request in its own
sequence with its own plan. Every greedy answer equals the same request's answer alone (or differs only at a
proven near-tie), a disconnect or a bad request among them disturbs none of the others, and the requests
really run at once (the health endpoint sees them)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from test_serve import KEY, PROMPTS, ServerProc, _long_stream, ask, wait_for

from specquant_cli.bench import fidelity

N = 16


@pytest.fixture(scope="module")
def parallel_server(family_dir):
    s = ServerProc(["--family", str(family_dir), "--parallel", "4", "--policies", "parent,spec-q4,ngram,auto,suffix",
                    "--policy", "parent", "--api-key", KEY])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def alone(parallel_server):
    """Each prompt's greedy answer with nothing else running, per policy."""
    c = parallel_server.client()
    return {(p, pol): ask(c, p, extra_body={"specquant_policy": pol}) for pol in ("parent", "spec-q4")
            for p in PROMPTS}


@pytest.fixture(scope="module")
def judge(parent_judge):
    return lambda prompt, text: parent_judge(prompt, text, N)


def explained(judge, answers: dict, alone: dict) -> list:
    """The answers that differ from their answer alone and are neither the parent's own answer nor a proven
    near-tie of it (the answer alone may itself be the near-tie)."""
    return [(k, a) for k, a in answers.items() if a != alone[k] and judge(k[0], a) == fidelity.UNEXPLAINED]


@pytest.mark.slow
def test_concurrent_clients_get_their_own_answers(parallel_server, alone, judge):
    jobs = [(p, pol) for pol in ("parent", "spec-q4") for p in PROMPTS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = dict(zip(jobs, pool.map(lambda j: ask(parallel_server.client(), j[0],
                                                    extra_body={"specquant_policy": j[1]}), jobs)))
    assert all(got.values())
    assert explained(judge, got, alone) == []
    assert parallel_server.health()["failed"] == 0


@pytest.mark.slow
def test_requests_run_at_once_and_a_disconnect_disturbs_none_of_the_others(parallel_server, alone, judge):
    c = parallel_server.client()
    before = parallel_server.health()
    stream, _ = _long_stream(c)  # one long answer running
    with ThreadPoolExecutor(3) as pool:
        futs = {p: pool.submit(ask, parallel_server.client(), p) for p in PROMPTS[:3]}
        assert wait_for(lambda: parallel_server.health()["running"] >= 2, timeout=60)
        stream.close()  # the long one goes; the others carry on in their sequences
        got = {(p, "parent"): f.result(timeout=120) for p, f in futs.items()}
    assert explained(judge, got, alone) == []
    assert wait_for(lambda: parallel_server.health()["cancelled"] == before["cancelled"] + 1, timeout=30)


@pytest.mark.slow
def test_a_bad_request_among_good_ones_fails_alone(parallel_server, alone, judge):
    c = parallel_server.client()
    with ThreadPoolExecutor(4) as pool:
        good = {p: pool.submit(ask, parallel_server.client(), p) for p in PROMPTS[3:6]}
        with pytest.raises(openai.BadRequestError) as e:  # the prompt plus max_tokens exceed the context
            ask(c, "word " * 5000)
        got = {(p, "parent"): f.result(timeout=120) for p, f in good.items()}
    assert e.value.status_code == 400
    assert explained(judge, got, alone) == []


@pytest.mark.slow
def test_sampled_and_drafted_requests_mix_with_greedy_ones(parallel_server, alone, judge):
    kinds = [("parent", {}), ("ngram", {}), ("auto", {}),
             ("parent", {"temperature": 0.8, "seed": 7}), ("spec-q4", {"temperature": 0.8, "seed": 7})]

    def one(kind):
        pol, kw = kind
        r = parallel_server.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=N,
            temperature=kw.get("temperature", 0), seed=kw.get("seed"), extra_body={"specquant_policy": pol})
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(len(kinds)) as pool:
        got = list(pool.map(one, kinds))
    assert all(text and finish in ("stop", "length") for text, finish in got)
    for (text, _), (pol, kw) in zip(got, kinds):
        if not kw:  # greedy: the parent's answer, whichever policy
            assert text == alone[(PROMPTS[0], "parent")] or judge(PROMPTS[0], text) != fidelity.UNEXPLAINED, pol


@pytest.mark.slow
def test_health_and_the_start_line_say_how_many_run_at_once(parallel_server):
    h = parallel_server.health()
    assert h["parallel"] == 4 and h["running"] == 0
    assert "4 at once" in parallel_server.log()


@pytest.mark.slow
def test_one_requests_answer_drafts_for_the_next_through_the_shared_memory(parallel_server, alone, judge):
    """Every slot reads and writes one drafting memory per policy: a question asked again, in whichever slot,
    drafts the earlier answer from its first token; the answers stay the parent's; /health shows the memory
    within its budget."""
    prompt = "Write the numbers from one to twenty in words, separated by commas."

    def suffix(client):
        return client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=48, temperature=0, extra_body={"specquant_policy": "suffix"})

    parent = parallel_server.client().chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0,
        extra_body={"specquant_policy": "parent"}).choices[0].message.content
    first = suffix(parallel_server.client())
    with ThreadPoolExecutor(3) as pool:  # three at once, in three slots: each drafts from the memory
        again = list(pool.map(lambda _: suffix(parallel_server.client()), range(3)))
    for r in [first, *again]:
        text = r.choices[0].message.content
        assert text == parent or judge(prompt, text) != fidelity.UNEXPLAINED
    sq_first, sq_again = first.model_extra["specquant"], [r.model_extra["specquant"] for r in again]
    assert all(s["accepted"] >= first.usage.completion_tokens - 8 for s in sq_again), (sq_first, sq_again)
    assert all(s["parent_calls"] < first.usage.completion_tokens / 2 for s in sq_again)
    use = parallel_server.health()["draft_memory"]["suffix"]
    assert 0 < use["tokens"] <= use["max_tokens"] and use["documents"] >= 4
