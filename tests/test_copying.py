"""Copies that survive an edit (decoding.copying, decoding.suffix): an answer that copies its prompt or a prediction
realigns after an insertion, a deletion and a substitution without waiting for a fresh match; a substitution it made
once (a rename) is proposed at the document's next occurrence, as one token or several; one that does not hold there
is forgotten; a copy that holds gets long drafts; and no draft changes an answer (the
real engine over a scripted parent, every answer token for token the parent's)."""

from __future__ import annotations

from specquant_cli.decoding.copying import Edits, Place, follow
from specquant_cli.decoding.engine import Engine
from specquant_cli.decoding.gamma import COPY_GAMMA_MAX, FixedGamma
from specquant_cli.decoding.prediction import PredictionDrafter
from specquant_cli.decoding.protocols import CycleOutcome
from specquant_cli.decoding.suffix import COPY_MATCH, SuffixDrafter

from fakes import FakeContext, FakeModel, peaked

V, EOG = 96, 95
PROMPT = [90, 91, 92]
OLD, NEW, NEW2 = 80, 81, 82  # a name in the file, its new name (one token), a second token of a longer new name
# "the file": 200 tokens with no 3-gram repeats, the name OLD every 20 tokens from token 10 on
FILE = [OLD if i % 20 == 10 else (7 * i) % 61 + 1 for i in range(200)]
RENAMES = FILE.count(OLD)


def flat_ish(n: int) -> float:  # a parent call's cost by its tokens, relative to one: long drafts are cheap
    return 1.0 + 0.02 * (n - 1)


def replaced(seq, old, new):
    out = []
    for t in seq:
        out += new if t == old else [t]
    return out


def oracle(drafter, prompt, answer, cap=COPY_GAMMA_MAX):
    """Drive `drafter` as the engine does against a parent whose greedy answer is `answer`: (parent calls, the drafts
    each with the answer position it was proposed at)."""
    seq = list(prompt) + answer[:1]  # the first token is the parent's own step
    drafter.prepare(seq)
    calls, drafts = 1, []
    while len(seq) - len(prompt) < len(answer):
        pos = len(seq) - len(prompt)
        room = len(answer) - pos - 1
        d = drafter.propose(seq, min(cap, room)).tokens if room > 0 else []
        k = 0
        while k < len(d) and d[k] == answer[pos + k]:
            k += 1
        drafts.append((pos, d))
        nxt = answer[pos + k]
        drafter.feedback(seq, CycleOutcome(len(d), k, nxt, 0.0, 0.0, len(d) + 1))
        seq += answer[pos:pos + k + 1]
        calls += 1
    return calls, drafts


def copier():
    return SuffixDrafter(verify_cost=flat_ish)


def plain_copy_calls(prompt=PROMPT + FILE, answer=FILE) -> int:
    """The parent calls of an answer that copies `answer` from the prompt unchanged: what an edit adds to."""
    return oracle(copier(), prompt, answer)[0]


def test_a_rename_is_learned_once_and_proposed_at_every_later_occurrence():
    answer = replaced(FILE, OLD, [NEW])
    calls, drafts = oracle(copier(), PROMPT + FILE, answer)
    # the first occurrence breaks the copy; every later one is drafted with the new name
    later = [d for pos, d in drafts if NEW in d]
    assert later and all(OLD not in d for _, d in drafts if _ > 40)
    # one call where the copy breaks, one to rejoin: without carrying the rename forward, one per occurrence (10)
    assert calls <= plain_copy_calls() + 2, calls


def test_a_rename_to_a_longer_name_is_carried_forward_with_its_context():
    """`lo` -> `lo` `w`: the answer inserts a token after the name; learned with the name as its context."""
    answer = replaced(FILE, OLD, [OLD, NEW2])
    calls, drafts = oracle(copier(), PROMPT + FILE, answer)
    assert any(NEW2 in d for _, d in drafts)
    assert calls <= plain_copy_calls() + 3, calls


def test_a_rename_to_a_shorter_name_drops_a_token_at_every_occurrence():
    name = [OLD, NEW2]  # a two-token name in the file, its last token dropped in the answer
    file = replaced(FILE, OLD, name)
    calls, drafts = oracle(copier(), PROMPT + file, FILE)
    assert calls <= plain_copy_calls(PROMPT + file, file) + 3, calls


def test_a_copy_realigns_after_an_insertion_a_deletion_and_a_substitution():
    edited = FILE[:50] + [NEW, NEW2] + FILE[50:100] + FILE[103:150] + [NEW] + FILE[151:]
    d = copier()
    calls, drafts = oracle(d, PROMPT + FILE, edited)
    # each edit costs the call where the copy departs and a few to find it again, not a fresh match's ramp
    assert calls <= plain_copy_calls() + 3 * 3, calls


def test_a_substitution_that_does_not_hold_is_forgotten():
    """The first occurrence renamed, the others not: the rename is proposed once at the second, then forgotten: the
    later occurrences are drafted as the document has them."""
    first = FILE.index(OLD)
    answer = FILE[:first] + [NEW] + FILE[first + 1:]
    d = copier()
    calls, drafts = oracle(d, PROMPT + FILE, answer)
    proposed_new = [pos for pos, x in drafts if NEW in x and pos > first + 1]
    assert len(proposed_new) <= 1
    assert (OLD,) not in d.edits.rules
    assert calls <= plain_copy_calls() + 4, calls


def test_a_copy_that_holds_gets_drafts_of_32_tokens_and_more():
    d = SuffixDrafter(verify_cost=lambda n: 1.0 + 0.1 * (n - 1))  # a call on 32 tokens costs 4 single ones
    calls, drafts = oracle(d, PROMPT + FILE, FILE)
    assert max(len(x) for _, x in drafts) >= 32


def test_follow_reads_substitutions():
    e = Edits()
    assert e.learn([5], [6, 7]) and not e.learn([5], [5]) and not e.learn([], [1])
    steps = follow([1, 5, 2, 5, 3], Place(100), 10, e)
    assert [s.token for s in steps] == [1, 6, 7, 2, 6, 7, 3]
    assert steps[1].opens == ((5,), 101) and steps[2].opens is None
    assert steps[-1].after == Place(105)
    assert [s.token for s in follow([5, 3], Place(100, (9,)), 10, e)] == [9, 6, 7, 3]
    e.refute((5,))
    assert [s.token for s in follow([1, 5, 2], Place(0), 10, e)] == [1, 5, 2]
    e.learn([1], [1, 4])  # an insertion after a context token: the context is the document's own
    steps = follow([1, 2], Place(0), 10, e)
    assert [s.token for s in steps] == [1, 4, 2] and steps[0].opens is None and steps[1].opens == ((1,), 1)


def test_a_learned_rename_is_proposed_at_its_next_occurrence():
    """After the answer renamed the name's first occurrence (FILE[10]) and went on copying, the draft that reaches its
    next occurrence (FILE[30]) proposes the new name there."""
    d = copier()
    answer = replaced(FILE[:25], OLD, [NEW])
    oracle(d, PROMPT + FILE, answer)
    assert d.edits.rules == {(OLD,): (NEW,)}
    draft = d.propose(PROMPT + FILE + answer, 64).tokens
    assert len(draft) > 6 and draft == replaced(FILE[25:25 + len(draft)], OLD, [NEW]) and draft[5] == NEW


def answers(answer):
    def fn(tokens):
        i = len(tokens) - len(PROMPT)
        return peaked(answer[i] if 0 <= i < len(answer) else EOG, V)
    return fn


def test_no_draft_changes_an_answer_and_a_prediction_carries_renames_too():
    edited = replaced(FILE[:100], OLD, [NEW]) + FILE[100:104] + [NEW2] + FILE[105:]
    for drafter, prompt in ((SuffixDrafter(verify_cost=flat_ish), PROMPT + FILE),
                            (PredictionDrafter(FILE, len(PROMPT), verify_cost=flat_ish), PROMPT)):
        ctx = FakeContext(FakeModel(V, EOG), lambda toks, n=len(prompt): peaked(
            edited[len(toks) - n] if 0 <= len(toks) - n < len(edited) else EOG, V), 2048)
        eng = Engine(ctx, drafter, FixedGamma(COPY_GAMMA_MAX), first_alone=True)
        events = list(eng.generate(prompt, 400))
        assert [e.token for e in events if not e.eog] == edited
        assert eng.stats.parent_calls <= plain_copy_calls() + 4, (drafter.name, eng.stats.parent_calls)


def test_a_rate_guard_that_rests_looks_again_where_the_answer_repeats_a_source():
    """An answer that opens with a novel sentence (its drafting stopped by the rate guard) and then copies the file:
    drafting starts again at the copy, and the answer is the parent's own."""
    from specquant_cli.decoding.gamma import RateGuard

    novel = [(11 * i) % 60 + 1 for i in range(30)]  # not in the file (its 3-grams are the file's own only by chance)
    answer = novel + FILE
    guard = RateGuard(FixedGamma(COPY_GAMMA_MAX), lambda pos: 0.1, len(PROMPT) + len(FILE))
    guard.tripped_at = 0  # resting from the first token, as after a novel opening
    n = len(PROMPT) + len(FILE)
    ctx = FakeContext(FakeModel(V, EOG), lambda toks: peaked(
        answer[len(toks) - n] if 0 <= len(toks) - n < len(answer) else EOG, V), 2048)
    eng = Engine(ctx, SuffixDrafter(verify_cost=flat_ish), guard, first_alone=True)
    events = list(eng.generate(PROMPT + FILE, 400))
    assert [e.token for e in events if not e.eog] == answer
    assert eng.stats.guard_reopened >= 1 and eng.stats.guard_stop == 0
    # the novel part one call a token, the copy once a match of COPY_MATCH tokens offers it (resting: a call a token)
    assert eng.stats.parent_calls <= len(novel) + COPY_MATCH + plain_copy_calls(), eng.stats.parent_calls


def test_the_prediction_follows_a_longer_draft_of_its_own_text_from_the_policy_drafter():
    """The policy's suffix drafter copies the prediction's text from the prompt in drafts longer than the prediction's
    own (counted as the prediction's): the prediction's drafter follows what the parent kept of them."""
    answer = [59] + FILE  # a novel first token: no copy of the prediction stands at the start
    inner = SuffixDrafter(verify_cost=lambda n: 1.0)  # flat: the longest drafts
    d = PredictionDrafter(FILE, len(PROMPT) + len(FILE), inner=inner, verify_cost=lambda n: 1.0 + 0.5 * (n - 1))
    prompt = PROMPT + FILE
    ctx = FakeContext(FakeModel(V, EOG), lambda toks: peaked(
        answer[len(toks) - len(prompt)] if 0 <= len(toks) - len(prompt) < len(answer) else EOG, V), 2048)
    eng = Engine(ctx, d, FixedGamma(COPY_GAMMA_MAX), first_alone=True)
    assert [e.token for e in eng.generate(prompt, 300) if not e.eog] == answer
