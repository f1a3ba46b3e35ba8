"""Per-token provenance: which drafter proposed each accepted token (engine), the (text, source) spans of each
response record (stream) and the `specquant` object of the SSE chunks (schemas). Scripted logits only."""

from types import SimpleNamespace

from specquant_cli.decoding.drafters import FallbackDrafter, NGramDrafter
from specquant_cli.decoding.engine import Engine
from specquant_cli.decoding.gamma import FixedGamma
from specquant_cli.decoding.stream import _split, stream_generate
from specquant_cli.decoding.suffix import SuffixDrafter
from specquant_cli.names import SOURCES
from specquant_cli.serving.replies import ChunkMaker, specquant_info

from fakes import FakeContext, FakeModel, ScriptedDrafter, peaked

V, EOG = 16, 15
counting = lambda toks: peaked((toks[-1] + 1) % 14, V)  # noqa: E731  the parent continues 1, 2, 3, ...


def engine(drafter, gamma=4):
    return Engine(FakeContext(FakeModel(V, EOG), counting), drafter, FixedGamma(gamma))


def sources(eng, prompt, max_tokens):
    return [(ev.token, ev.source) for ev in eng.generate(list(prompt), max_tokens)]


def test_a_model_draft_is_draft_and_the_parents_own_token_is_parent():
    got = sources(engine(ScriptedDrafter([[1, 2, 9], [4]])), [0], 5)
    assert got == [(1, "draft"), (2, "draft"), (3, "parent"), (4, "draft"), (5, "parent")]
    assert sources(engine(None), [0], 2) == [(1, "parent"), (2, "parent")]


def test_draft_free_drafters_are_suffix():
    assert SuffixDrafter.source == NGramDrafter.source == "suffix"
    got = sources(engine(NGramDrafter((2,))), [0, 1, 2, 3, 0, 1], 3)  # the prompt repeats: 2, 3 are copied
    assert got == [(2, "suffix"), (3, "suffix"), (4, "parent")]  # 0 was proposed, the parent said 4


def test_a_mixed_drafter_tells_its_two_drafters_apart():
    # n-gram first (none until the answer repeats the prompt's 4, 5, 6), the scripted model otherwise
    mixed = FallbackDrafter(NGramDrafter((3,)), ScriptedDrafter([[1, 2]]), activate_after=0)
    got = sources(engine(mixed), [4, 5, 6, 7, 0], 8)
    assert [s for _, s in got] == ["draft", "draft", "parent", "parent", "parent", "parent", "suffix", "parent"]
    assert [t for t, _ in got] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_split_cuts_spans_at_a_character():
    spans = [("<1>", "draft"), ("<2>", "parent")]
    assert _split(spans, 4) == ([("<1>", "draft"), ("<", "parent")], [("2>", "parent")])
    assert _split(spans, 0) == ([], spans) and _split(spans, 99) == (spans, [])


def records(drafter, stop=(), max_tokens=6):
    return list(stream_generate(engine(drafter), [0], max_tokens, stop))


def test_record_spans_add_up_to_the_text_through_held_back_tails_and_stops():
    for stop in ((), (">X",), ("3><",)):  # none; a tail ">" held back every time; a stop inside two tokens
        recs = records(ScriptedDrafter([[1, 2, 3], [5]]), stop)
        for r in recs:
            assert "".join(text for text, _ in r.spans) == r.text and all(text for text, _ in r.spans)
            assert {s for _, s in r.spans} <= set(SOURCES)
    recs = records(ScriptedDrafter([[1, 2, 3], [5]]))
    assert [s for r in recs for s in r.spans] == [("<1>", "draft"), ("<2>", "draft"), ("<3>", "draft"),
                                                  ("<4>", "parent"), ("<5>", "draft"), ("<6>", "parent")]
    recs = records(ScriptedDrafter([[1, 2, 3], [5]]), ("3><",))
    assert [s for r in recs for s in r.spans] == [("<1>", "draft"), ("<2>", "draft"), ("<", "draft")]
    assert recs[-1].finish_reason == "stop"
    recs = records(ScriptedDrafter([[1, 2, 3], [5]]), (">X",))
    assert recs[0].spans == [("<1", "draft")]  # ">" waits: it could start ">X"
    assert recs[1].spans == [(">", "draft"), ("<2", "draft")] and recs[-1].spans == [(">", "parent")]
    assert "".join(t for r in recs for t, _ in r.spans) == "<1><2><3><4><5><6>"


def _answer(why=""):
    plan = SimpleNamespace(policy="auto", describe=lambda: "suffix drafts, f16 verifies", why=why, lossy=False)
    return SimpleNamespace(route=SimpleNamespace(tier="low", score=0.25), plan=plan)


def test_chunks_carry_spans_and_running_figures_and_the_plan_once():
    recs = records(ScriptedDrafter([[1, 2, 3]]), max_tokens=4)
    answer = _answer("suffix predicted 2.00x (measured)")
    chat = ChunkMaker(True, "m", False)
    opening = chat.first(answer)["specquant"]
    assert opening["plan"] == "suffix drafts, f16 verifies" and opening["route"]["tier"] == "low"
    assert opening["why"].startswith("suffix predicted")
    sq = chat.text(answer, recs[0])["specquant"]
    assert sq["spans"] == [{"text": "<1>", "source": "draft"}] and "plan" not in sq
    assert sq["tokens"] == recs[0].new_tokens and set(sq) >= {"tokens_per_s", "acceptance_rate", "mean_accepted_length"}
    completion = ChunkMaker(False, "m", False)
    assert completion.first(answer) is None
    firsts = [completion.text(answer, r)["specquant"] for r in recs[:2]]
    assert "plan" in firsts[0] and "plan" not in firsts[1]
    final = specquant_info(answer, recs[-1])
    assert final["why"] and final["tokens"] == 4 and final["accepted"] == 3 and "spans" not in final
