"""One tenant's prompts are theirs alone, and the prompt cache's folder is private and within its budget.

The prompt cache, prefix sharing and the drafting memory are scoped (a tenant, narrowed by a cache_salt): nothing
of one scope is found, copied, restored or drafted from by another. The folder is 0700 with 0600 files, never
written or read through a link, pruned oldest first to one budget across restarts and across servers sharing it
(under a lock), and what it refuses is named with why; the key its MACs are made with is refused when others can
read it or it is a link."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import stat
import subprocess
import time

import pytest

from specquant_cli.decoding.memory import DraftMemory, ScopedMemory
from specquant_cli.decoding.suffix import SuffixDrafter
from specquant_cli.errors import InputError
from specquant_cli.runtime.prompt_cache import (
    ENTRY_OVERHEAD,
    KEY_FILE,
    LOCK_FILE,
    SUFFIX,
    PromptCache,
    private_folder,
    user_key,
)

KEY = b"k" * 32
NOBODY = 65534  # a real second user: Debian's nobody


def state(n: int, fill: int = 7) -> tuple[ctypes.Array, int]:
    return (ctypes.c_uint8 * n)(*([fill] * n)), n


def size_of(tokens: int, nbytes: int) -> int:
    return nbytes + 4 * tokens + ENTRY_OVERHEAD


def files(folder) -> list:
    return sorted(folder.glob(f"*{SUFFIX}"))


def folder_bytes(folder) -> int:
    return sum(p.stat().st_size for p in files(folder))


class Warnings:
    def __init__(self):
        self.lines: list[str] = []

    def warn(self, line: str) -> None:
        self.lines.append(line)


# -- scopes in the prompt cache -------------------------------------------------------------------------------------
def test_an_entry_is_found_only_by_its_own_scope():
    c = PromptCache(1 << 20, "t")
    secret = list(range(200))
    c.put(secret, state(64), scope="alice")
    assert c.best(secret, "alice")[1] == 200
    assert c.best(secret, "bob") == (None, 0)  # the same tokens: nothing, not even a count of matching ones
    assert c.best(secret[:150] + [7], "") == (None, 0)
    assert c.covers(secret, "alice") and not c.covers(secret, "bob")


def test_a_longer_state_replaces_only_its_own_scopes_prefix():
    c = PromptCache(1 << 20, "t")
    c.put(list(range(40)), state(10), scope="a")
    c.put(list(range(80)), state(10), scope="b")
    assert c.status()["entries"] == 2 and c.covers(list(range(40)), "a")


def test_the_scope_survives_the_folder(tmp_path):
    PromptCache(1 << 20, "t", tmp_path, key=KEY).put(list(range(30)), state(32), scope="alice")
    back = PromptCache(1 << 20, "t", tmp_path, key=KEY)
    assert back.best(list(range(30)), "alice")[1] == 30 and back.best(list(range(30)), "bob")[1] == 0


# -- private files --------------------------------------------------------------------------------------------------
def test_the_folder_is_made_private_and_its_files_too(tmp_path):
    folder = private_folder(tmp_path / "cache", "--cache-dir")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    PromptCache(1 << 20, "t", folder, key=KEY).put(list(range(30)), state(32))
    (f,) = files(folder)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE((folder / LOCK_FILE).stat().st_mode) == 0o600


def test_a_file_is_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        PromptCache(1 << 20, "t", private_folder(tmp_path / "c", "--cache-dir"), key=KEY).put([1] * 20, state(8))
    finally:
        os.umask(old)
    assert stat.S_IMODE(files(tmp_path / "c")[0].stat().st_mode) == 0o600


def test_a_folder_others_can_read_is_narrowed_and_said(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    w = Warnings()
    private_folder(folder, "--cache-dir", w)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert len(w.lines) == 1 and "755" in w.lines[0] and "private" in w.lines[0]


def test_another_user_cannot_read_what_the_cache_writes(tmp_path):
    """A real second user (nobody), with the folders above open to it: the cache folder and its files stay shut."""
    os.chmod(tmp_path, 0o755)
    folder = private_folder(tmp_path / "c", "--cache-dir")
    PromptCache(1 << 20, "t", folder, key=KEY).put(list(range(30)), state(32))
    f = files(folder)[0]
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "cat", str(f)],
                       capture_output=True)
    assert r.returncode != 0 and b"Permission denied" in r.stderr, r


def test_a_cache_folder_that_is_a_link_or_another_users_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(InputError, match="symbolic link"):
        private_folder(tmp_path / "link", "--cache-dir")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(InputError, match="another user"):
        private_folder(theirs, "--cache-dir")


def test_a_lock_file_planted_as_a_link_is_never_followed(tmp_path):
    folder = private_folder(tmp_path / "c", "--cache-dir")
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (folder / LOCK_FILE).symlink_to(victim)
    c = PromptCache(1 << 20, "t", folder, key=KEY)  # start-up: the folder is not read through the link
    assert c.put([1] * 20, state(8))  # the entry stands in RAM; the folder only loses it
    assert victim.read_bytes() == b"keep" and files(folder) == []


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "specquant"


def test_the_key_is_made_private_and_read_back(home):
    key = user_key()
    assert len(key) == 32 and user_key() == key
    assert stat.S_IMODE((home / KEY_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700


def test_a_key_others_can_read_is_refused_with_the_fix(home):
    user_key()
    os.chmod(home / KEY_FILE, 0o644)
    with pytest.raises(InputError, match=f"chmod 600 {home / KEY_FILE}"):
        user_key()


def test_a_key_that_is_a_link_is_refused(home, tmp_path):
    home.mkdir(parents=True)
    other = tmp_path / "elsewhere.key"
    other.write_bytes(b"x" * 32)
    os.chmod(other, 0o600)
    (home / KEY_FILE).symlink_to(other)
    with pytest.raises(InputError, match="symbolic link"):
        user_key()


def test_a_key_of_another_user_is_refused(home):
    user_key()
    os.chown(home / KEY_FILE, NOBODY, NOBODY)
    with pytest.raises(InputError, match="another user"):
        user_key()


# -- the folder's budget --------------------------------------------------------------------------------------------
def test_the_folder_stays_within_its_budget_across_restarts(tmp_path):
    one = size_of(20, 100)
    for restart in range(4):
        c = PromptCache(3 * one, "t", tmp_path, key=KEY)
        for k in range(3):
            c.put([restart * 10 + k] * 20, state(100))
        assert folder_bytes(tmp_path) <= c.disk_budget, restart
    assert PromptCache(3 * one, "t", tmp_path, key=KEY).best([32] * 20)[1] == 20  # the newest stayed


def test_two_servers_sharing_a_folder_keep_each_others_files_within_the_budget(tmp_path):
    one = size_of(20, 100)
    a = PromptCache(one, "t", tmp_path, key=KEY, disk_budget=10 * one)
    b = PromptCache(one, "t", tmp_path, key=KEY, disk_budget=10 * one)
    a.put([1] * 20, state(100))
    b.put([2] * 20, state(100))
    a.put([3] * 20, state(100))  # a's RAM drops its first entry: its file stays, as b's does
    assert len(files(tmp_path)) == 3
    assert PromptCache(10 * one, "t", tmp_path, key=KEY).status()["entries"] == 3


def _writer(folder: str, base: int, budget: int) -> None:
    from pathlib import Path

    c = PromptCache(budget, "t", Path(folder), key=KEY, disk_budget=budget)
    for k in range(25):
        c.put([base + k] * 20, state(100))


def test_servers_writing_at_once_leave_the_folder_within_its_budget(tmp_path):
    budget = 5 * size_of(20, 100)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), 1000 * i, budget)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert 0 < folder_bytes(tmp_path) <= budget


def test_start_up_reads_the_newest_files_while_the_ram_budget_lasts(tmp_path):
    one = size_of(20, 100)
    w = PromptCache(10 * one, "t", tmp_path, key=KEY)
    for k in range(6):
        w.put([k] * 20, state(100))
        os.utime(max(files(tmp_path), key=lambda p: p.stat().st_mtime_ns),
                 (1000 + k, 1000 + k))
    c = PromptCache(2 * one, "t", tmp_path, key=KEY, disk_budget=10 * one)
    assert {e.tokens[0] for e in c._entries.values()} == {4, 5}
    assert len(files(tmp_path)) == 6  # the folder has room for all: none pruned


def test_files_of_another_key_are_named_with_why(tmp_path):
    PromptCache(1 << 20, "t", tmp_path, key=b"o" * 32).put([1] * 20, state(8))
    (old,) = files(tmp_path)
    w = Warnings()
    c = PromptCache(1 << 20, "t", tmp_path, report=w, key=KEY)
    assert c.status()["refused_files"] == 1
    assert len(w.lines) == 1 and old.name in w.lines[0] and "another key" in w.lines[0] and KEY_FILE in w.lines[0]


def test_files_of_another_key_are_pruned_oldest_first_with_the_rest(tmp_path):
    one = size_of(20, 100)
    PromptCache(10 * one, "t", tmp_path, key=b"o" * 32).put([1] * 20, state(100))
    (old,) = files(tmp_path)
    os.utime(old, (1, 1))
    c = PromptCache(one, "t", tmp_path, key=KEY)
    c.put([2] * 20, state(100))
    assert not old.exists() and len(files(tmp_path)) == 1


def test_a_sparse_file_is_not_read_and_is_removed(tmp_path):
    sparse = tmp_path / f"huge{SUFFIX}"
    with open(sparse, "wb") as f:
        f.truncate(2000 << 20)  # 2000 MB long, nothing on disk
    w = Warnings()
    t0 = time.monotonic()
    c = PromptCache(4000 << 20, "t", tmp_path, report=w, key=KEY)
    assert time.monotonic() - t0 < 2 and c.status()["entries"] == 0
    assert not sparse.exists() and "sparse" in w.lines[0] and sparse.name in w.lines[0]


def test_a_file_over_the_ram_budget_is_never_read_into_memory(tmp_path):
    big = tmp_path / f"big{SUFFIX}"
    big.write_bytes(b"SQPC3\n" + b"\1" * (8 << 20))
    w = Warnings()
    c = PromptCache(1 << 20, "t", tmp_path, report=w, key=KEY, disk_budget=64 << 20)
    assert c.status()["entries"] == 0 and "RAM budget" in w.lines[0]
    assert big.exists()  # within the folder's budget: left, and named


def test_a_link_in_the_folder_is_removed_not_followed(tmp_path):
    target = tmp_path.parent / f"{tmp_path.name}-target"
    target.write_bytes(b"x" * 100)
    (tmp_path / f"ln{SUFFIX}").symlink_to(target)
    w = Warnings()
    PromptCache(1 << 20, "t", tmp_path, report=w, key=KEY)
    assert not (tmp_path / f"ln{SUFFIX}").is_symlink() and target.read_bytes() == b"x" * 100
    assert "a link" in w.lines[0]


# -- scopes in the drafting memory ----------------------------------------------------------------------------------
def test_a_scope_drafts_only_from_its_own_documents():
    mem = DraftMemory(1 << 16)
    alice, bob = ScopedMemory(mem, "alice"), ScopedMemory(mem, "bob")
    secret = [5, 9, 2, 7, 1, 8, 3, 6, 4, 10, 11, 12]
    doc = alice.new_doc()
    alice.append(doc, secret)
    assert alice.match(secret[:5])[0] > 0
    assert bob.match(secret[:5]) == (0, [])
    a, b = SuffixDrafter(memory=alice, record=False), SuffixDrafter(memory=bob, record=False)
    got = a.propose(secret[:5], 4).tokens
    assert got and got == secret[5:5 + len(got)]
    assert b.propose(secret[:5], 4).tokens == []


def test_the_scopes_share_one_budget():
    mem = DraftMemory(40)
    for name in ("a", "b", "c"):
        s = ScopedMemory(mem, name)
        s.append(s.new_doc(), list(range(20)))
    assert mem.tokens <= 40 and mem.use()["scopes"] == 2
