"""The engine's accept/reject loop against scripted logits (the one fake)."""

import pytest

from specquant_cli.decoding.drafters import NGramDrafter
from specquant_cli.decoding.engine import Engine
from specquant_cli.decoding.gamma import FixedGamma
from specquant_cli.decoding.stream import generate_text, stream_generate
from specquant_cli.errors import InputError

from fakes import FakeContext, FakeModel, ScriptedDrafter, peaked

V, EOG = 16, 15
# The parent continues 1, 2, 3, ... (mod 14) after the prompt: next token = (last + 1) % 14.
counting = lambda toks: peaked((toks[-1] + 1) % 14, V)  # noqa: E731


def make(drafter, gamma=4, fn=counting, max_ctx=512):
    ctx = FakeContext(FakeModel(V, EOG), fn, max_ctx)
    return Engine(ctx, drafter, FixedGamma(gamma)), ctx


def run(engine, prompt=(0,), max_tokens=8):
    return [ev for ev in engine.generate(list(prompt), max_tokens)]


def test_all_accepted_gives_bonus_token():
    eng, ctx = make(ScriptedDrafter([[1, 2, 3, 4]]))
    evs = run(eng, max_tokens=5)
    assert [e.token for e in evs] == [1, 2, 3, 4, 5]
    assert [e.from_draft for e in evs] == [True] * 4 + [False]
    assert eng.stats.drafted == 4 and eng.stats.accepted == 4 and eng.stats.parent_calls == 1
    assert ctx.tokens == [0, 1, 2, 3, 4]  # parent holds all but the pending bonus token


def test_first_rejected_keeps_parent_token():
    eng, ctx = make(ScriptedDrafter([[9, 9, 9], [2, 3]]), gamma=3)
    evs = run(eng, max_tokens=4)
    assert [e.token for e in evs] == [1, 2, 3, 4]
    assert eng.stats.accepted == 2 and eng.stats.drafted == 5 and eng.stats.parent_calls == 2
    assert evs[0].from_draft is False


def test_last_rejected():
    eng, _ = make(ScriptedDrafter([[1, 2, 7]]), gamma=3)
    evs = run(eng, max_tokens=3)
    assert [e.token for e in evs] == [1, 2, 3] and eng.stats.accepted == 2


def test_eog_inside_accepted_draft_stops_there():
    fn = lambda toks: peaked(EOG if toks[-1] == 2 else (toks[-1] + 1) % V, V)  # noqa: E731
    eng, _ = make(ScriptedDrafter([[1, 2, EOG, 5]]), fn=fn)
    evs = run(eng, max_tokens=10)
    assert [e.token for e in evs] == [1, 2, EOG] and evs[-1].eog
    text, toks, last = generate_text(make(ScriptedDrafter([[1, 2, EOG, 5]]), fn=fn)[0], [0], 10)
    assert last.finish_reason == "stop" and EOG not in toks and text == "<1><2>"


def test_max_tokens_inside_draft_caps_the_draft():
    d = ScriptedDrafter([[1, 2, 3, 4, 5, 6, 7, 8]])
    eng, _ = make(d, gamma=8)
    evs = run(eng, max_tokens=3)
    assert [e.token for e in evs] == [1, 2, 3]
    assert eng.stats.drafted == 2  # γ was capped to leave room for the parent's own token


def test_empty_ngram_proposal_is_a_plain_parent_step():
    eng, _ = make(NGramDrafter((3, 2)))
    evs = run(eng, prompt=(0,), max_tokens=4)
    assert [e.token for e in evs] == [1, 2, 3, 4] and eng.stats.drafted == 0 and eng.stats.parent_calls == 4


def test_stop_string_inside_accepted_draft():
    eng, _ = make(ScriptedDrafter([[1, 2, 3, 4, 5, 6]]), gamma=6)
    text, toks, last = generate_text(eng, [0], 20, stop=["<3>"])
    assert text == "<1><2>" and last.finish_reason == "stop"


def test_context_overflow_is_refused_before_decoding():
    eng, ctx = make(None, max_ctx=10)
    with pytest.raises(InputError, match="exceeds the context size 10"):
        run(eng, prompt=list(range(8)), max_tokens=5)
    assert ctx.decode_calls == 0


def test_interrupt_ends_with_what_was_produced():
    class Interrupting(ScriptedDrafter):
        def propose(self, seq, n, sp=None, noise=None):
            if self.calls == 2:
                raise KeyboardInterrupt
            return super().propose(seq, n, sp, noise)

    eng, ctx = make(Interrupting([[1, 2], [3, 4], [5]]), gamma=2)
    recs = list(stream_generate(eng, [0], 20))
    assert recs[-1].finish_reason == "interrupted"
    assert "".join(r.text for r in recs) == "<1><2><3><4>" and recs[-1].new_tokens == 4
    # the context is still usable: the next generation re-syncs from the prefix cache
    eng2 = Engine(ctx, None, FixedGamma(0))
    assert [e.token for e in eng2.generate([0, 1, 2, 3, 4], 2)] == [5, 6]


def test_stop_string_split_across_token_pieces_is_held_back():
    """"><3" spans the pieces "<2>" and "<3>": the ">" of "<2>" must be held back until "<3>" decides."""
    eng, _ = make(ScriptedDrafter([]), gamma=0)
    recs = list(stream_generate(eng, [0], 10, stop=["><3"]))
    texts = [r.text for r in recs]
    assert texts[:2] == ["<1", "><2"]  # each record holds back the trailing ">" that could start the stop
    assert "".join(texts) == "<1><2" and recs[-1].finish_reason == "stop"


def test_held_back_text_is_released_when_the_stop_does_not_complete():
    eng, _ = make(ScriptedDrafter([]), gamma=0)
    recs = list(stream_generate(eng, [0], 3, stop=["><9"]))
    assert "".join(r.text for r in recs) == "<1><2><3>" and recs[-1].finish_reason == "length"


def test_drafter_hears_each_cycle_outcome():
    d = ScriptedDrafter([[1, 2, 9], [4]])
    eng, _ = make(d, gamma=3)
    run(eng, max_tokens=5)
    first, second = d.outcomes[:2]
    assert (first.proposed, first.accepted, first.next_token, first.scored) == (3, 2, 3, 4)
    assert (second.proposed, second.accepted, second.next_token) == (1, 1, 5)
    assert first.verify_s > 0 and first.draft_s >= 0


def test_first_alone_gives_the_first_token_before_the_drafter_prepares_or_drafts():
    class Watching(ScriptedDrafter):
        def __init__(self, proposals, events):
            super().__init__(proposals)
            self.events = events

        def prepare(self, seq):
            self.events.append(("prepare", len(seq)))

        def propose(self, seq, n, sp=None, noise=None):
            self.events.append(("propose", len(seq)))
            return super().propose(seq, n, sp, noise)

    events: list = []
    ctx = FakeContext(FakeModel(V, EOG), counting, 512)
    eng = Engine(ctx, Watching([[2, 3, 4, 5]], events), FixedGamma(4), first_alone=True)
    out = []
    for ev in eng.generate([0], 6):
        out.append(ev)
        events.append(("token", ev.token))
    assert [e.token for e in out] == [1, 2, 3, 4, 5, 6]  # the same tokens as without it
    assert events[:3] == [("token", 1), ("prepare", 2), ("propose", 2)]  # out before any drafter work
    assert eng.stats.parent_calls == 2 and eng.stats.drafted == 4
    assert len(eng.drafter.outcomes) == 1  # the first token's step is no drafting cycle
