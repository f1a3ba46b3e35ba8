"""Prefill once (runtime.prefixes): a prompt takes the longest computed prefix there is — another sequence's cells
(llama_memory_seq_cp), a cached state in RAM or on disk — and what it takes gives the tokens a cold prefill gives.
The prompt cache stays within its budget, least recently used out, and refuses a folder entry of another model,
build or context size, or a damaged one."""

from __future__ import annotations

import ctypes
import threading

import pytest

from specquant_cli.backend.llama import Context
from specquant_cli.decoding.batch import Batcher, SeqView
from specquant_cli.decoding.engine import Engine
from specquant_cli.runtime.prefixes import MIN_REUSE, PrefixSharing
from specquant_cli.runtime.prompt_cache import ENTRY_OVERHEAD, SUFFIX, PromptCache

N = 12  # greedy tokens compared
KEY = b"k" * 32  # the MAC key of the folder tests (a server uses runtime.prompt_cache.user_key)


def state(n: int, fill: int = 7) -> tuple[ctypes.Array, int]:
    buf = (ctypes.c_uint8 * n)(*([fill] * n))
    return buf, n


def size_of(tokens: int, nbytes: int) -> int:
    return nbytes + 4 * tokens + ENTRY_OVERHEAD


# -- the cache alone (its states are opaque bytes to it) --------------------------------------------------------
def test_the_longest_shared_prefix_wins_and_becomes_the_most_recent():
    c = PromptCache(1 << 20, "t")
    c.put(list(range(100)), state(10))
    c.put([1, 2, 3] * 40, state(10))
    entry, n = c.best(list(range(60)) + [999])
    assert n == 60 and list(entry.tokens) == list(range(100))
    assert c.best([5, 5, 5])[0] is None


def test_eviction_keeps_the_budget_and_drops_the_least_recently_used():
    one = size_of(50, 1000)
    c = PromptCache(3 * one, "t")
    for k in range(3):
        assert c.put([k] * 50, state(1000))
    c.use(c.best([0] * 50)[0])  # entry 0 was restored: the most recent now, so entry 1 goes first
    c.put([3] * 50, state(1000))
    assert c.bytes <= c.budget
    kept = {e.tokens[0] for e in c._entries.values()}
    assert kept == {0, 2, 3}
    assert c.status()["evictions"] == 1
    assert not c.put([9] * 50, state(4 * one))  # alone over the budget: refused, nothing evicted for it
    assert {e.tokens[0] for e in c._entries.values()} == {0, 2, 3}


def test_a_longer_state_replaces_the_entries_it_extends():
    c = PromptCache(1 << 20, "t")
    c.put(list(range(40)), state(10))
    c.put(list(range(80)), state(10))
    assert c.status()["entries"] == 1 and c.covers(list(range(40))) and c.covers(list(range(80)))
    assert not c.covers(list(range(81)))


def test_a_folder_entry_is_read_back_and_a_foreign_or_damaged_one_refused(tmp_path):
    a = PromptCache(1 << 20, "tag-a", tmp_path, key=KEY)
    a.put(list(range(30)), state(64, fill=3))
    assert a.flush(30) and a.pending() == 0
    files = sorted(tmp_path.glob(f"*{SUFFIX}"))
    assert len(files) == 1
    back = PromptCache(1 << 20, "tag-a", tmp_path, key=KEY)
    entry, n = back.best(list(range(30)))
    assert n == 30 and bytes(entry.state) == bytes([3] * 64)
    assert PromptCache(1 << 20, "tag-b", tmp_path, key=KEY).status()["entries"] == 0  # another model, build or context
    raw = bytearray(files[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    damaged = PromptCache(1 << 20, "tag-a", tmp_path, key=KEY)
    assert damaged.status()["entries"] == 0 and damaged.status()["refused_files"] == 1
    (tmp_path / f"short{SUFFIX}").write_bytes(b"SQ")
    assert PromptCache(1 << 20, "tag-a", tmp_path, key=KEY).status()["refused_files"] == 2
    assert files[0].exists()  # refused, not deleted: it may be another server's


def test_an_evicted_entry_leaves_the_folder_too(tmp_path):
    c = PromptCache(size_of(20, 100) + 10, "t", tmp_path, key=KEY)
    c.put([1] * 20, state(100))
    c.put([2] * 20, state(100))
    assert c.flush(30)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1
    assert PromptCache(1 << 20, "t", tmp_path, key=KEY).best([2] * 20)[1] == 20


def test_a_put_does_not_wait_for_the_folder(tmp_path, monkeypatch):
    """The state is in RAM at once and the request goes on; the writer thread writes it, `flush` waits for it."""
    c = PromptCache(1 << 20, "t", tmp_path, key=KEY, write_behind=True)
    go, started = threading.Event(), threading.Event()
    write = c._write

    def slow_disk(entry):
        started.set()
        assert go.wait(30)
        write(entry)

    monkeypatch.setattr(c, "_write", slow_disk)
    c.put(list(range(40)), state(64))
    c.put(list(range(100, 140)), state(64))
    assert started.wait(30)
    assert c.best(list(range(40)))[1] == 40 and c.pending() == 2  # usable now, not on disk yet
    assert not c.flush(0.05) and list(tmp_path.glob(f"*{SUFFIX}")) == []
    go.set()
    assert c.flush(30) and c.pending() == 0
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2
    assert PromptCache(1 << 20, "t", tmp_path, key=KEY).best(list(range(100, 140)))[1] == 40


def test_a_failed_folder_write_loses_only_that_file(tmp_path, monkeypatch):
    c = PromptCache(1 << 20, "t", tmp_path, key=KEY, write_behind=True)
    write, calls = c._write, []

    def flaky(entry):
        calls.append(entry)
        if len(calls) == 1:
            raise RuntimeError("disk gone")
        write(entry)

    monkeypatch.setattr(c, "_write", flaky)
    c.put([1] * 20, state(32))
    c.put([2] * 20, state(32))
    assert c.flush(30) and len(calls) == 2
    assert c.best([1] * 20)[1] == 20  # the RAM entry stands
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1  # the writer went on


# -- real contexts -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared(models):
    """Two sequences of one unified F16 context behind a batcher, as serve --parallel 2 runs them."""
    ctx = Context(models["f16"], 2 * 1024, n_seq_max=2, kv_unified=True)
    batcher = Batcher()
    views = [SeqView(ctx, i, batcher, 1024) for i in range(2)]
    yield ctx, batcher, views
    ctx.close()


@pytest.fixture(scope="module")
def prompts(models):
    m = models["f16"]
    system = "You answer questions about the harbour of Wellington. " * 12
    return [m.chat_prompt([{"role": "system", "content": system}, {"role": "user", "content": q}])
            for q in ("Name one ship.", "What is the weather like?", "Who built the pier?")]


@pytest.fixture(scope="module")
def cold(models):
    """Greedy tokens of each prompt from a context of its own, prefilled from nothing."""
    ctx = Context(models["f16"], 1024)

    def run(prompt):
        ctx.reset()
        return [e.token for e in Engine(ctx).generate(prompt, N)]

    yield run
    ctx.close()


def with_cache(shared):
    """(batcher, views, cache, sharing): the shared context's sequences emptied, sharing a fresh RAM cache."""
    _, batcher, views = shared
    for v in views:
        v.reset()
    cache = PromptCache(256 << 20, "real")
    return batcher, views, cache, PrefixSharing(views, cache, batcher.ops, batcher.away)


def greedy(batcher, view, prompt) -> list[int]:
    with batcher.member():
        return [e.token for e in Engine(view).generate(prompt, N)]


def test_a_prefix_copied_from_another_sequence_gives_the_cold_prefills_tokens(shared, prompts, cold):
    _, batcher, views = shared
    sharing = PrefixSharing(views, None, batcher.ops, batcher.away)
    for v in views:
        v.reset()
    a, b = prompts[0], prompts[1]
    assert greedy(batcher, views[0], a) == cold(a)
    got = greedy(batcher, views[1], b)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common > 100 and sharing.status()["copied_tokens"] == common
    assert got == cold(b)
    assert views[1].tokens == list(b) + got[:-1]  # what the sequence holds is what it says


def test_a_state_restored_from_ram_or_disk_gives_the_cold_prefills_tokens(shared, prompts, cold, models, tmp_path):
    ctx, batcher, views = shared
    for v in views:
        v.reset()
    from specquant_cli.runtime.prompt_cache import cache_tag

    cache = PromptCache(256 << 20, "real", tmp_path, key=KEY, write_behind=True)  # as a server writes
    sharing = PrefixSharing(views, cache, batcher.ops, batcher.away)
    a, c = prompts[0], prompts[2]
    greedy(batcher, views[0], a)
    held = list(views[0].tokens)
    with batcher.member():
        views[0].prefill([1, 2, 3] * 10)  # the slot is reused: what it held goes to the cache first
    assert cache.status()["entries"] == 1 and cache.covers(held)
    assert greedy(batcher, views[1], c) == cold(c)  # takes the system prompt from the cache
    assert cache.status()["hits"] == 1 and sharing.status()["restored_tokens"] > 100
    assert views[1].tokens[:len(c) - 1] == list(c[:-1])
    # a later server: the folder only
    assert cache.flush(60)
    disk = PromptCache(256 << 20, "real", tmp_path, key=KEY)
    for v in views:
        v.reset()
    PrefixSharing(views, disk, batcher.ops, batcher.away)
    assert greedy(batcher, views[0], a) == cold(a)
    assert disk.status()["hits"] == 1
    assert cache_tag is not None and sharing.cache is cache


def test_a_prefill_waits_for_another_of_the_same_prefix_and_takes_it(shared, prompts, cold):
    _, batcher, views = shared
    for v in views:
        v.reset()
    sharing = PrefixSharing(views, None, batcher.ops, batcher.away)
    got: dict[int, list[int]] = {}
    go = threading.Barrier(2)

    def run(i, prompt):
        go.wait()
        got[i] = greedy(batcher, views[i], prompt)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts[:2])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got[0] == cold(prompts[0]) and got[1] == cold(prompts[1])
    common = next(i for i, (x, y) in enumerate(zip(*prompts[:2])) if x != y)
    assert sharing.counts["waits"] > 0 and sharing.status()["copied_tokens"] >= common - MIN_REUSE


def test_without_reuse_every_prompt_is_prefilled_whole(shared, prompts):
    _, batcher, views = shared
    for v in views:
        v.reset()
    PrefixSharing(views, None, batcher.ops, batcher.away, reuse=False)
    with batcher.member():
        assert views[0].prefill(prompts[0]) == len(prompts[0])
        assert views[1].prefill(prompts[1]) == len(prompts[1])
        assert views[0].prefill(prompts[0]) == len(prompts[0])  # not even its own prefix


def test_a_sequence_prefills_in_chunks_while_another_decodes(models):
    ctx = Context(models["f16"], 2 * 512, n_seq_max=2, kv_unified=True)
    batcher = Batcher()
    views = [SeqView(ctx, i, batcher, 512, prefill_chunk=32) for i in range(2)]
    sizes = []
    run = views[0]._decode_run
    views[0]._decode_run = lambda chunk, rows: (sizes.append(len(chunk)), run(chunk, rows))
    with batcher.member(), batcher.member():  # another request is decoding beside it
        views[0].prefill(list(range(1, 101)))
    with batcher.member():
        views[0].reset()
        views[0].prefill(list(range(1, 101)))
    assert sizes == [32, 32, 32, 4, 100]
    ctx.close()


def test_the_cache_tag_names_the_weights_build_and_context(family):
    from specquant_cli.runtime.prompt_cache import cache_tag

    assert cache_tag(family, 1024) == cache_tag(family, 1024) != cache_tag(family, 2048)


def test_a_folder_entry_that_is_a_link_a_fifo_or_too_big_is_never_read(tmp_path):
    import os

    (tmp_path / f"zero{SUFFIX}").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / f"fifo{SUFFIX}")
    (tmp_path / f"big{SUFFIX}").write_bytes(b"\0" * (3 << 20))
    c = PromptCache(1 << 20, "t", tmp_path, key=KEY)  # returns: nothing blocks on the FIFO or reads /dev/zero forever
    assert c.status()["entries"] == 0 and c.status()["refused_files"] == 3


def test_a_longer_cached_state_wins_over_another_sequences_shorter_prefix(shared, prompts, cold):
    batcher, views, cache, sharing = with_cache(shared)
    a, b = prompts[0], prompts[1]
    greedy(batcher, views[0], a)
    held = list(views[0].tokens)  # a conversation's first turn: its prompt and answer
    with batcher.member():
        views[0].prefill(b)  # another conversation takes the slot: the first goes to the cache
    copied = sharing.status()["copied_tokens"]
    follow = held + list(b[-4:])  # its next turn: everything it held, and more
    with batcher.member():
        decoded = views[1].prefill(follow)
    assert decoded == len(follow) - len(held)  # restored whole from the cache, not the system prompt from seq 0
    assert sharing.status()["copied_tokens"] == copied and cache.status()["hits"] == 1
    assert views[1].tokens == follow


def test_a_file_made_with_another_key_or_a_hostile_header_is_refused(tmp_path):
    import hashlib
    import hmac

    from specquant_cli.runtime.prompt_cache import MAGIC

    PromptCache(1 << 20, "t", tmp_path, key=b"x" * 32).put([1] * 20, state(64))  # another user's key
    for i, head in enumerate([b'{"tag": "t", "tokens": 1e999, "state": 64}', b"[" * 100000, b'"t"',
                              b'{"tag": "t", "tokens": 20.0, "state": 64}']):
        body = MAGIC + head + b"\n" + bytes(4 * 20 + 64)
        (tmp_path / f"h{i}{SUFFIX}").write_bytes(body + hmac.new(KEY, body, hashlib.sha256).digest())
    c = PromptCache(1 << 20, "t", tmp_path, key=KEY)  # no exception: every one is refused
    assert c.status()["entries"] == 0 and c.status()["refused_files"] == 5


def test_the_folder_keeps_files_its_ram_does_not_hold(tmp_path):
    one = size_of(20, 100)
    writer = PromptCache(10 * one, "t", tmp_path, key=KEY)
    for k in range(3):
        writer.put([k] * 20, state(100))
    assert writer.flush(30)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 3
    small = PromptCache(one, "t", tmp_path, key=KEY, disk_budget=10 * one)  # holds the newest; the files stay
    assert small.status()["entries"] == 1 and small.bytes <= small.budget
    assert small.best([2] * 20)[1] == 20  # the newest file is the one read
    small.put([9] * 20, state(100))  # evicts the one it read from RAM: its file stays (the folder has room)
    assert small.flush(30)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 4


def test_an_entry_whose_state_is_not_what_its_tokens_say_is_dropped_and_the_prompt_prefilled(shared, prompts, cold):
    batcher, views, cache, sharing = with_cache(shared)
    with batcher.member():
        views[0].prefill(prompts[0][:40])
    cache.put(list(prompts[2][:-1]), views[0].ctx.export_state(0))  # 40 positions under a longer prompt's tokens
    views[0].reset()
    assert greedy(batcher, views[1], prompts[2]) == cold(prompts[2])
    assert cache.status()["entries"] == 0 and cache.status()["hits"] == 0
    assert sharing.status()["restored_tokens"] == 0


def test_slots_with_contexts_of_their_own_copy_a_prefix_as_bytes_and_only_within_a_scope(models, prompts, cold):
    """The deterministic mode's slots (runtime.pool.ModelPool.own_caches): each a context of its own, all sequence 0.
    A peer's prefix comes as its state's bytes and gives the cold prefill's tokens; a scope is still a view's own, so
    another tenant's slot gives nothing."""
    ctxs = [Context(models["f16"], 1024) for _ in range(2)]
    try:
        batcher = Batcher()
        views = [SeqView(c, 0, batcher, 1024) for c in ctxs]
        sharing = PrefixSharing(views, None, batcher.ops, batcher.away)
        a, b = prompts[0], prompts[1]
        sharing.enter(0, "alice")
        assert greedy(batcher, views[0], a) == cold(a)
        sharing.enter(1, "bob")
        with batcher.member():
            sharing.prefill(views[1], b)
        assert sharing.status()["copied_tokens"] == 0 and sharing.scope(0) == "alice"
        sharing.enter(1, "alice")
        got = greedy(batcher, views[1], b)
        common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        assert sharing.status()["copied_tokens"] >= common - 1 and got == cold(b)
    finally:
        for c in ctxs:
            c.close()
