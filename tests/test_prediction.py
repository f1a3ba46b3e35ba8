"""Predicted Outputs: a request's `prediction` drafted from (decoding.prediction), never changing an answer; its
accounting (accepted / rejected prediction tokens) what the engine did; OpenAI's refusals; `chat --predict`; the
auto planner's plan for a copied answer, priced from the measured call-cost curve (calibrations pinned here)."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
from hostile_util import assert_clean_error

from specquant_cli.bench import datasets
from specquant_cli.decoding.drafters import FallbackDrafter
from specquant_cli.decoding.engine import Engine
from specquant_cli.decoding.gamma import COPY_GAMMA_MAX, SUFFIX_GAMMA_MAX, FixedGamma, copy_length
from specquant_cli.decoding.prediction import PredictionDrafter
from specquant_cli.decoding.protocols import CycleOutcome
from specquant_cli.decoding.suffix import SuffixDrafter
from specquant_cli.routing.plan import PlanContext
from specquant_cli.routing.policies import plan_for
from specquant_cli.serving.schemas import ApiError, chat_params, completion_params
from specquant_cli.system import calibration_file
from specquant_cli.system.calibration import LONG_CALLS, MAX_BATCH, Calibration

from conftest import clear_seeds, run_cli, sampled_verdict
from fakes import FakeContext, FakeModel, ScriptedDrafter, peaked

V, EOG = 64, 63
PROMPT = [60, 61, 62]
FILE = [(7 * i) % 50 + 1 for i in range(120)]  # "the file": 120 tokens, no 3-gram repeats
EDITED = FILE[:40] + [55] + FILE[41:80] + [56, 57] + FILE[80:]  # a substitution and an insertion


def flat_ish(n: int) -> float:  # a parent call's cost by its tokens, relative to one: long drafts are cheap
    return 1.0 + 0.02 * (n - 1)


def answers(answer):
    """Logits of a parent whose greedy answer after PROMPT is `answer`, then EOG."""
    def fn(tokens):
        i = len(tokens) - len(PROMPT)
        return peaked(answer[i] if 0 <= i < len(answer) else EOG, V)
    return fn


class Spy(PredictionDrafter):
    """Records every draft it proposes from the prediction, and where."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.drafts = []

    def propose(self, seq, n, sp=None, noise=None):
        d = super().propose(seq, n, sp, noise)
        if d.tokens and self.source == "prediction":
            self.drafts.append((len(seq) - len(PROMPT), list(d.tokens)))
        return d


def run_engine(drafter, answer, max_tokens=200, gamma=COPY_GAMMA_MAX):
    ctx = FakeContext(FakeModel(V, EOG), answers(answer), 1024)
    eng = Engine(ctx, drafter, FixedGamma(gamma), first_alone=True)
    events = list(eng.generate(list(PROMPT), max_tokens))
    return eng, events


def expected_counts(drafts, answer):
    """(accepted, rejected) of drafts against the parent's greedy `answer`: each kept up to its first miss."""
    acc = rej = 0
    for pos, toks in drafts:
        k = 0
        while k < len(toks) and pos + k < len(answer) and toks[k] == answer[pos + k]:
            k += 1
        acc, rej = acc + k, rej + len(toks) - k
    return acc, rej


# -- the drafter and the engine's accounting ------------------------------------------------------------------------

def test_prediction_drafts_the_file_through_its_edits_and_the_engine_counts_what_it_did():
    d = Spy(FILE, len(PROMPT), verify_cost=flat_ish)
    eng, events = run_engine(d, EDITED)
    assert [e.token for e in events if not e.eog] == EDITED  # the parent's own answer, whatever was drafted
    acc, rej = expected_counts(d.drafts, EDITED)
    st = eng.stats
    assert (st.prediction_accepted, st.prediction_proposed - st.prediction_accepted) == (acc, rej)
    assert sum(e.source == "prediction" for e in events) == acc  # each kept prediction token is an event of its own
    # it follows the copy, departs at each edit and rejoins it within two tokens: a dozen parent calls for 122 tokens
    assert acc >= len(EDITED) - 12 and st.parent_calls <= 12


def test_the_records_carry_the_accounting():
    from specquant_cli.decoding.stream import generate_text

    d = Spy(FILE, len(PROMPT), verify_cost=flat_ish)
    ctx = FakeContext(FakeModel(V, EOG), answers(EDITED), 1024)
    eng = Engine(ctx, d, FixedGamma(COPY_GAMMA_MAX), first_alone=True, prediction=FILE)
    _, tokens, last = generate_text(eng, PROMPT, 200)
    # OpenAI's accounting: the prediction's tokens that appear in the answer (all but the one replaced), and the rest
    assert tokens == EDITED and (last.prediction_accepted, last.prediction_rejected) == (len(FILE) - 1, 1)
    assert last.stats()["prediction_accepted"] == len(FILE) - 1 and last.stats()["prediction_rejected"] == 1


def test_nothing_past_a_stop_string_is_counted():
    """The parent keeps a long draft whose middle holds the stop string: the answer is cut there, and the kept drafts,
    the prediction's among them, count only up to the cut (the usage never counts more than completion_tokens)."""
    from specquant_cli.decoding.stream import appeared, generate_text

    d = Spy(FILE, len(PROMPT), verify_cost=flat_ish)
    ctx = FakeContext(FakeModel(V, EOG), answers(FILE), 1024)
    eng = Engine(ctx, d, FixedGamma(COPY_GAMMA_MAX), first_alone=True, prediction=FILE)
    text, tokens, last = generate_text(eng, PROMPT, 200, stop=[f"<{FILE[30]}>"])
    assert tokens == FILE[:31] and last.finish_reason == "stop" and last.new_tokens == 31
    assert eng.stats.drafted > 31  # the parent kept drafts past the stop
    assert last.accepted <= last.new_tokens and last.prediction_accepted <= last.new_tokens
    assert last.prediction_accepted == appeared(FILE, FILE[:31]) == 31
    assert last.prediction_rejected == len(FILE) - 31


def test_the_usage_is_a_function_of_the_request_alone():
    """The same request three times over one shared drafting memory (a server's): the second and third find the answer
    in the memory before the prediction does, and report the same counts as the first."""
    from specquant_cli.decoding.memory import DraftMemory
    from specquant_cli.decoding.stream import generate_text

    shared = DraftMemory()
    seen = []
    for _ in range(3):
        inner = SuffixDrafter(verify_cost=flat_ish, memory=shared)
        d = PredictionDrafter(FILE, len(PROMPT), inner=inner, verify_cost=flat_ish)
        ctx = FakeContext(FakeModel(V, EOG), answers(EDITED), 1024)
        eng = Engine(ctx, d, FixedGamma(COPY_GAMMA_MAX), first_alone=True, prediction=FILE)
        _, tokens, last = generate_text(eng, PROMPT, 200)
        assert tokens == EDITED
        seen.append((last.prediction_accepted, last.prediction_rejected))
    assert seen == [(len(FILE) - 1, 1)] * 3


def test_a_wrong_prediction_gives_way_to_the_policy_drafter():
    """The answer copies the prompt (the inner suffix drafter has it); the prediction is another text: the inner
    drafter's drafts carry the answer, and the prediction's few drafts are soon sized down to none."""
    other = [(11 * i + 3) % 50 + 1 for i in range(120)]
    inner = SuffixDrafter(verify_cost=flat_ish)
    d = Spy(other, len(PROMPT) + len(FILE), inner=inner, verify_cost=flat_ish)
    ctx = FakeContext(FakeModel(V, EOG), lambda toks: peaked(FILE[(len(toks) - len(PROMPT)) % len(FILE)], V), 2048)
    eng = Engine(ctx, d, FixedGamma(COPY_GAMMA_MAX), first_alone=True)
    events = list(eng.generate(PROMPT + FILE, 110))
    assert [e.token for e in events] == FILE[:110]
    assert sum(e.source == "suffix" for e in events) >= 100
    assert eng.stats.prediction_proposed <= 16 and eng.stats.prediction_accepted == 0


def test_a_prediction_without_a_policy_drafter_proposes_only_from_itself():
    d = PredictionDrafter(FILE, len(PROMPT), verify_cost=flat_ish)
    d.prepare(PROMPT + FILE[:1])
    assert d.propose(PROMPT + FILE[:1], 8).tokens == FILE[1:9] and d.source == "prediction"
    d.prepare(PROMPT + [59])  # the answer did not start as the prediction does: nothing to draft yet
    assert d.propose(PROMPT + [59], 8).tokens == []


def test_the_policy_drafter_keeps_its_own_draft_length():
    inner = ScriptedDrafter([[1, 2, 3, 4, 5, 6, 7, 8]])
    d = PredictionDrafter([], len(PROMPT), inner=inner, inner_gamma=FixedGamma(3))
    d.prepare(PROMPT)
    assert d.propose(PROMPT, 40).tokens == [1, 2, 3] and d.source == "draft"


def test_a_suffix_copy_rejoins_the_prompt_after_an_edit():
    """Without a prediction: an answer that copies its prompt drafts on from where the copy stands, and after an
    edit from where it rejoins the prompt (a token replaced: at once; a few inserted: once the copy's next token
    comes), not after a fresh match of MIN_MATCH tokens."""
    d = SuffixDrafter(verify_cost=flat_ish)
    seq = PROMPT + FILE + [59] + FILE[:30]
    d.prepare(seq)
    first = d.propose(seq, 60).tokens
    assert first == FILE[30:30 + len(first)] and len(first) > 10
    d.feedback(seq, CycleOutcome(len(first), 10, 55, 0.0, 0.0, len(first) + 1))  # the parent departs at FILE[40]
    seq = seq + FILE[30:40] + [55]
    guess = d.propose(seq, 60).tokens  # [55] took FILE[40]'s place: on from FILE[41]
    assert guess and guess == FILE[41:41 + len(guess)]
    d.feedback(seq, CycleOutcome(len(guess), 0, 56, 0.0, 0.0, len(guess) + 1))  # no: 55, 56 are inserted
    seq = seq + [56]
    assert d.propose(seq, 60).tokens == []  # [56] is nowhere near: nothing yet
    seq = seq + [FILE[40]]
    again = d.propose(seq, 60).tokens
    assert again and again == FILE[41:41 + len(again)]


def test_a_mix_leaves_its_model_out_while_the_answer_copies():
    first = ScriptedDrafter([[1] * 40, []])
    model = ScriptedDrafter([[9, 9]])
    mix = FallbackDrafter(first, model, activate_after=0)
    prompt = [5] * 10
    mix.prepare(prompt)
    assert len(mix.propose(prompt, 64, None, None).tokens) == 40
    mix.feedback(prompt, CycleOutcome(40, 40, 1, 0.0, 0.0, 41))
    seq = prompt + [1] * 41
    assert mix.propose(seq, 64, None, None).tokens == [] and model.calls == 0  # copying: no model call


# -- the planner ----------------------------------------------------------------------------------------------------

def linear_curve(step: float, per_token: float, sizes) -> dict[int, float]:
    """A BF16-like curve: a one-token call, then a fixed cost plus a price per token."""
    return {n: step if n == 1 else 1.5 * step + per_token * (n - 2) for n in sizes}


LONG = linear_curve(0.084, 0.008, [*range(1, MAX_BATCH + 1), *LONG_CALLS])
SHORT = {n: s for n, s in LONG.items() if n <= MAX_BATCH}  # a calibration stored before the long calls were measured


def test_auto_plans_a_copy_with_a_prediction_from_the_curve():
    cal = Calibration(dict(LONG), {"q4": 0.03}, agreement={"q4": 0.95})
    want = copy_length(cal.verify_cost, cal.longest_call)
    assert SUFFIX_GAMMA_MAX < want <= COPY_GAMMA_MAX  # the curve pays past 32 tokens
    plan = plan_for("auto", "medium", PlanContext("auto", "medium", 0.1, ("parent", "q4"), cal, 300, 600, 400))
    assert plan.drafter == "suffix" and plan.gamma_policy == "capped" and plan.gamma_cap == want
    assert "prediction" in plan.why and plan.roles == ["parent"]  # no draft model paid for a written answer
    plain = plan_for("auto", "medium", PlanContext("auto", "medium", 0.1, ("parent", "q4"), cal, 300, 600))
    assert plain.drafter != "suffix" or plain.gamma_cap == want  # without one, as before (its copy runs capped alike)


def test_an_older_calibration_plans_within_what_it_measured():
    cal = Calibration(dict(SHORT), {"q4": 0.03}, agreement={"q4": 0.95})
    plan = plan_for("auto", "medium", PlanContext("auto", "medium", 0.1, ("parent", "q4"), cal, 300, 600, 400))
    assert plan.gamma_cap == SUFFIX_GAMMA_MAX and "specquant calibrate" in plan.why


def test_a_stored_calibration_with_or_without_the_long_calls_loads(tmp_path):
    fp = {"schema": calibration_file.SCHEMA, "cpu": "test"}
    for curve in (LONG, SHORT):
        calibration_file.save(tmp_path, fp, Calibration(dict(curve)))
        got, why = calibration_file.load_checked(tmp_path, fp)
        assert why is None and got.parent_call_s == curve
    assert 0.084 < Calibration(dict(LONG)).call_s(40) < LONG[48]  # between the measured long calls: interpolated
    bad = {k: v for k, v in LONG.items() if k != 7}  # a long call without every short one
    stored = json.loads(json.dumps(Calibration(bad).to_dict()))  # as the file holds it
    assert "are not 1..N" in calibration_file.entry_problem(stored)


# -- the wire format: OpenAI's rules ---------------------------------------------------------------------------------

def resolve(p):
    return p or "auto"


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra,param", [
    ({"prediction": {"type": "text", "content": "x"}}, "prediction.type"),
    ({"prediction": "x"}, "prediction"),
    ({"prediction": {"type": "content", "content": 5}}, "prediction.content"),
    ({"prediction": {"type": "content", "content": []}}, "prediction.content"),
    ({"prediction": {"type": "content", "content": [{"type": "image_url"}]}}, "prediction.content[0]"),
    ({"prediction": {"type": "content", "content": "x"}, "logprobs": True}, "logprobs"),
    ({"prediction": {"type": "content", "content": "x"}, "max_completion_tokens": 9}, "max_completion_tokens"),
    ({"prediction": {"type": "content", "content": "x"}, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ({"prediction": {"type": "content", "content": "x"}, "audio": {"voice": "alloy"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}, "modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}, "n": 2}, "n"),
    ({"prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5}, "presence_penalty"),
])
def test_refusals_are_openais(extra, param):
    with pytest.raises(ApiError) as e:
        chat_params({**CHAT, **extra}, resolve)
    assert e.value.status == 400 and e.value.param == param and e.value.type == "invalid_request_error"


def test_a_prediction_is_a_string_or_its_text_parts_joined():
    parts = [{"type": "text", "text": "def f():\n"}, {"type": "text", "text": "    return 1\n"}]
    p = chat_params({**CHAT, "prediction": {"type": "content", "content": parts}}, resolve)
    assert p.prediction == "def f():\n    return 1\n"
    assert chat_params({**CHAT, "prediction": {"type": "content", "content": "abc"}, "modalities": ["text"]},
                       resolve).prediction == "abc"
    assert completion_params({"model": "m", "prompt": "hi", "prediction": {"type": "content", "content": "x"}},
                             resolve).prediction == "x"
    assert chat_params(dict(CHAT), resolve).prediction is None


def test_the_edit_set_has_a_prediction_each_and_a_wrong_one_is_another_item_s():
    items = datasets.load([], edits=True)
    assert len(items) >= 6 and all(it.prediction and it.prediction in it.prompt for it in items)
    wrong = datasets.with_predictions(items, "wrong")
    assert all(w.prediction and w.prediction != it.prediction for w, it in zip(wrong, items))
    assert all(w.prediction is None for w in datasets.with_predictions(items, "off"))


# -- for real: the demo family ---------------------------------------------------------------------------------------

ASK = "Write a Python function that returns the area of a rectangle."
N = 32
WRONG = "import os\nprint(os.getcwd())\n" * 4  # another text altogether


@pytest.fixture(scope="module")
def server(family_dir):
    from test_serve import ServerProc

    s = ServerProc(["--family", str(family_dir), "--parallel", "1", "--policies", "auto,suffix,spec-q4,parent",
                    "--ctx", "1024"])
    yield s
    s.stop()


def _ask(client, policy, prediction=None, **kw):
    extra = {"specquant_policy": policy, "cache_salt": uuid.uuid4().hex}  # a fresh drafting memory each time
    if prediction is not None:
        kw["prediction"] = {"type": "content", "content": prediction}
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}], max_tokens=N,
                                          temperature=0, extra_body=extra, **kw)


@pytest.fixture(scope="module")
def expected(server) -> str:
    """The parent's own greedy answer: the right prediction (the prompt does not hold it: only the prediction can
    draft it)."""
    return _ask(server.client(key="none"), "parent").choices[0].message.content


def _same_or_tie(request, texts: list[str]) -> None:
    """Greedy answers of one prompt are the same text, or each one the parent's own up to a proven near-tie."""
    if len(set(texts)) > 1:
        judge = request.getfixturevalue("parent_judge")
        assert all(judge(ASK, t, N) in ("identical", "near-tie") for t in texts), texts


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["auto", "spec-q4"])
def test_a_prediction_never_changes_a_greedy_answer_and_usage_counts_it(server, expected, policy, request):
    client = server.client(key="none")
    plain, right, wrong = _ask(client, policy), _ask(client, policy, expected), _ask(client, policy, WRONG)
    _same_or_tie(request, [expected] + [r.choices[0].message.content for r in (plain, right, wrong)])
    d = right.usage.completion_tokens_details
    assert N // 2 < d.accepted_prediction_tokens <= right.usage.completion_tokens and d.rejected_prediction_tokens >= 0
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert plain.usage.completion_tokens_details.rejected_prediction_tokens == 0
    w = wrong.usage.completion_tokens_details  # another text: a few of its tokens (a newline, a parenthesis) appear
    assert w.accepted_prediction_tokens < N // 4 and w.rejected_prediction_tokens > 0


@pytest.mark.slow
def test_the_server_counts_the_same_request_alike_and_nothing_past_a_stop(server, expected):
    """The same new request three times in one scope (the drafting memory holds the first answer when the second
    comes): the same usage each time. Cut by a stop string inside a kept copy: no count beyond completion_tokens."""
    client = server.client(key="none")
    salt = uuid.uuid4().hex
    usages = []
    for _ in range(3):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": ASK}], max_tokens=N,
                                           temperature=0, prediction={"type": "content", "content": expected},
                                           extra_body={"specquant_policy": "suffix", "cache_salt": salt})
        d = r.usage.completion_tokens_details
        usages.append((d.accepted_prediction_tokens, d.rejected_prediction_tokens))
    assert usages[0] == usages[1] == usages[2] and usages[0][0] > N // 2
    stop = expected[len(expected) // 2:len(expected) // 2 + 3]
    for stream in (False, True):
        kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        r = _ask(client, "suffix", expected, stop=[stop], **kw)
        last = list(r)[-1] if stream else r
        usage, info = last.usage, last.model_extra.get("specquant") or {}
        assert usage.completion_tokens < N
        assert usage.completion_tokens_details.accepted_prediction_tokens <= usage.completion_tokens
        if "accepted" in info:
            assert info["accepted"] <= usage.completion_tokens


@pytest.mark.slow
def test_streamed_usage_carries_the_same_accounting(server, expected):
    client = server.client(key="none")
    whole = _ask(client, "suffix", expected)
    chunks = list(_ask(client, "suffix", expected, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text == whole.choices[0].message.content
    assert usage.completion_tokens_details.accepted_prediction_tokens == \
        whole.usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert usage.completion_tokens_details.rejected_prediction_tokens == \
        whole.usage.completion_tokens_details.rejected_prediction_tokens
    assert sum(s["source"] == "prediction" for c in chunks for s in (c.model_extra.get("specquant") or {}).get(
        "spans", [])) <= usage.completion_tokens_details.accepted_prediction_tokens


@pytest.mark.slow
def test_the_server_refuses_as_openai_does(server):
    client = server.client(key="none")
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, "auto", "x", logprobs=True)
    assert e.value.body["param"] == "logprobs" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="hi", max_tokens=4,
                                  extra_body={"prediction": {"type": "words", "content": "x"}})
    assert e.value.body["param"] == "prediction.type"
    huge = "word " * 3000  # far more tokens than the 1024-token context
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
        "prediction": {"type": "content", "content": huge}})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")  # before any stream
    assert r.json()["error"]["param"] == "prediction.content" and "context" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def session(family_dir):
    from specquant_cli.decoding.sampling import SamplingParams
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings, resolve

    given = {"runtime.family": family_dir, "runtime.threads": 1, "runtime.ctx": 1024}
    cfg = resolve(list(given), given)
    s = open_session(SessionSettings.of(cfg, sampling=SamplingParams(), max_tokens=N))
    yield s
    s.runtime.close()


def _answer(session, policy, sp, prediction=None):
    """The answer, and every record's spans in `answer.spans`."""
    answer, records = session.ask_messages([{"role": "user", "content": ASK}], policy=policy, sampling=sp,
                                           max_tokens=N, prediction=session.prediction_tokens(prediction),
                                           scope=uuid.uuid4().hex)
    answer.spans = [span for rec in records for span in rec.spans]
    return answer


@pytest.mark.slow
def test_the_session_plans_the_copy_and_counts_what_the_answer_holds(session, request):
    from specquant_cli.decoding.sampling import GREEDY

    own = _answer(session, "parent", GREEDY)
    a = _answer(session, "auto", GREEDY, own.text)
    _same_or_tie(request, [own.text, a.text])
    assert a.plan.drafter == "suffix" and "prediction" in a.plan.why
    kept = sum(src == "prediction" for _, src in a.spans)  # a token of no text of its own has no span
    assert a.last.new_tokens >= a.last.prediction_accepted >= kept > N // 2


STORY = "Tell me a short story about a lighthouse."
SAMPLED = 16


@pytest.mark.slow
def test_a_prediction_never_changes_a_sampled_answer(session, models):
    """The same seed, the same answer: without a prediction, with the parent's own sample as one, with a wrong one
    (seeds whose samples lead their next candidate clear of the batch-shape noise: conftest.clear_seeds)."""
    from specquant_cli.decoding.sampling import SamplingParams

    for seed, samples in clear_seeds(models["f16"], STORY, SAMPLED, count=1).items():
        sp = SamplingParams(temperature=0.9, seed=seed)
        texts = []
        for p in (None, "".join(samples[0]), WRONG):
            answer, records = session.ask_messages([{"role": "user", "content": STORY}], policy="auto", sampling=sp,
                                                   max_tokens=SAMPLED, prediction=session.prediction_tokens(p),
                                                   scope=uuid.uuid4().hex)
            texts.append("".join(r.text for r in records))
        for text in texts:
            assert sampled_verdict(text, samples) == "identical"
        assert texts[0] == texts[1] == texts[2]


@pytest.mark.slow
def test_chat_predict_reports_the_accounting(family_dir, tmp_path, monkeypatch):
    base = ["chat", "--family", str(family_dir), "--max-tokens", str(N), "--ctx", "1024", "--threads", "1"]
    r = run_cli([*base, "--policy", "parent", ASK])
    assert r.exit_code == 0, r.stderr
    f = tmp_path / "expected.py"
    f.write_text(r.stdout[:-1])  # the parent's own answer: the right prediction
    r = run_cli([*base, "--json", "--predict", str(f), ASK])
    assert r.exit_code == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    assert stats["prediction_accepted"] > N // 2 and stats["prediction_rejected"] >= 0
    r = run_cli([*base, "--stats", "--predict", "-", ASK], input=f.read_text())  # the prediction from a pipe
    assert r.exit_code == 0, r.stderr
    assert f"prediction {stats['prediction_accepted']} accepted / {stats['prediction_rejected']} rejected" in r.stderr
    r = run_cli([*base, "--predict", "-"], input="x")  # stdin cannot be both
    assert r.exit_code == 1 and "--predict -" in r.stderr
    r = run_cli([*base, "--predict", str(tmp_path / "missing.py"), "hi"])
    assert r.exit_code == 1 and "--predict" in r.stderr


# -- bench prompts: a dataset's predictions checked before a model loads ---------------------------------------------

BENCH = ["bench", "prompts", "--policies", "parent", "--max-tokens", "2", "--warmup", "0", "--threads", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("line, field", [('{"turns": ["x"], "prediction": "\\ud800"}', "'prediction'"),
                                         ('{"turns": ["x \\udfff"]}', "'turns'")])
def test_bench_prompts_refuses_a_lone_surrogate_in_a_dataset_in_one_line(family_dir, tmp_path, line, field):
    ds = tmp_path / "odd.jsonl"
    ds.write_text(line + "\n")  # JSON's escape of half a surrogate pair: valid JSON, never valid UTF-8
    r = run_cli([*BENCH, "--family", str(family_dir), "--dataset", str(ds)])
    assert_clean_error(r, 1, f"{ds}:1: not a Spec-Bench question: {field} holds a lone surrogate")


@pytest.mark.slow
@pytest.mark.parametrize("args, needle", [
    (["--edits", "--limit", "1"], "no other item has a different prediction to give edits:1 (item edits:edit-1)"),
    (["--categories", "qa", "--limit", "1"], "no item has a prediction")])
def test_bench_prompts_refuses_a_wrong_prediction_with_no_other_item_to_borrow(family_dir, args, needle):
    """A row run as --prediction wrong without one would be a run with no prediction, labelled wrong."""
    r = run_cli([*BENCH, "--family", str(family_dir), *args, "--prediction", "wrong"])
    assert_clean_error(r, 1, "--prediction wrong: " + needle)
    assert "tok/s" not in r.stderr  # refused before anything ran


@pytest.mark.slow
def test_bench_prompts_names_the_file_and_item_of_a_prediction_longer_than_the_context(family_dir, tmp_path):
    ds = tmp_path / "long.jsonl"
    ds.write_text(json.dumps({"question_id": "big", "turns": ["Edit it."], "prediction": WRONG * 40}) + "\n")
    r = run_cli([*BENCH, "--family", str(family_dir), "--dataset", str(ds), "--ctx", "256"])
    assert_clean_error(r, 1, f"{ds}:1 (item long:big): the prediction is ", "longer than the context (256 tokens)")
    assert "tok/s" not in r.stderr  # refused before a model loaded


# -- bench load sends predictions -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["on", "off", "wrong"])
def test_bench_load_sends_each_edit_s_prediction(mode):
    from test_loadtest import FakeServer

    srv = FakeServer()
    try:
        r = run_cli(["bench", "load", "--json", "--url", srv.url, "--edits", "--conversations", "3",
                     "--prediction", mode])
        assert r.exit_code == 0, r.stderr
    finally:
        srv.close()
    items = datasets.load([], edits=True)
    sent = [q["body"].get("prediction") for q in srv.requests]
    assert len(sent) == 3
    for item, p, q in zip(items, sent, srv.requests):
        assert q["body"]["messages"][-1]["content"] == item.prompt
        if mode == "off":
            assert p is None
        else:
            assert p["type"] == "content" and (p["content"] == item.prediction) == (mode == "on")
    rep = json.loads(r.stdout)
    assert rep["summary"]["predicted"] == (0 if mode == "off" else 3) and rep["config"]["prediction"] == mode
    assert rep["summary"]["prediction_accepted"] is None  # this server says nothing of them


def test_bench_load_reads_the_usage_s_prediction_counts():
    from specquant_cli.bench.answer import RequestResult, Target, _Answer

    target = Target("http://x", "m", 64)
    r = RequestResult(0, 0, [], prediction="def f(): pass")
    a = _Answer(target, r, lambda: 0.0, 0.0)
    a.take(b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, '
           b'"completion_tokens_details": {"accepted_prediction_tokens": 7, "rejected_prediction_tokens": 3}}}')
    assert (r.prediction_accepted, r.prediction_rejected) == (7, 3)
    assert target.body([], "def f(): pass")["prediction"] == {"type": "content", "content": "def f(): pass"}
    assert "prediction" not in target.body([])
