"""Tenants on a real server, driven by the real openai client: each API key is a tenant, and what one tenant sent
(its prompts in the prompt cache and the slots, its answers in the drafting memory) never shortens, speeds up or
drafts another's request; a cache_salt narrows a tenant's scope further. /health without a key says only whether
the server lives. A seeded sampled answer is the same alone and beside other requests."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from test_serve import ServerProc

from conftest import clear_seeds, sampled_verdict

ALICE, BOB = "alice-key-0123456789", "bob-key-9876543210"
SYSTEM = ("You are the payroll assistant of Harbour Works. Confidential: the chief engineer's salary is {salary} "
          "dollars a year. Never reveal it. ") + "Answer questions about shifts, leave and overtime briefly. " * 6


@pytest.fixture(scope="module")
def server(family_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# the second tenant\n{BOB}\n")
    os.chmod(keys, 0o600)
    s = ServerProc(["--family", str(family_dir), "--parallel", "2", "--policies", "parent,suffix,spec-q4",
                    "--policy", "parent", "--api-key", ALICE, "--api-key-file", str(keys)])
    yield s
    s.stop()


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def cached(server, key: str, salary: str, salt: str | None = None, question: str = "How long is a shift?") -> int:
    extra = {"cache_salt": salt} if salt is not None else {}
    r = client(server, key).chat.completions.create(
        model="m", messages=[{"role": "system", "content": SYSTEM.format(salary=salary)},
                             {"role": "user", "content": question}],
        max_tokens=2, temperature=0, extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.slow
def test_the_start_line_says_each_key_is_a_tenant(server):
    assert "2 API keys: 2 tenants" in server.log()


@pytest.mark.slow
def test_another_tenant_cannot_read_a_prompt_through_cached_tokens(server):
    """Bob guesses the salary in Alice's system prompt: his right guess is prefilled as a wrong one is (each guess in a
    fresh scope of his, as an attacker would: his own earlier guesses are his to reuse)."""
    cached(server, ALICE, "187,400")  # Alice's prompt, computed once
    assert cached(server, ALICE, "187,400", question="Who approves leave?") > 60  # her own prefix: taken
    assert cached(server, BOB, "187,400") == 0  # Bob's first request: nothing of Alice's
    guesses = {g: cached(server, BOB, g, salt=f"guess-{g}") for g in ("187,400", "912,300", "185,000")}
    assert set(guesses.values()) == {0}, guesses


@pytest.mark.slow
def test_a_salt_narrows_a_tenants_scope_and_never_widens_it(server):
    cached(server, ALICE, "55,555", salt="team-a")
    assert cached(server, ALICE, "55,555", salt="team-a", question="Who approves leave?") > 60
    # the same tenant with another salt, or without one: nothing of team-a's (each probe the first of its scope)
    assert cached(server, ALICE, "55,555", salt="team-b") == 0
    assert cached(server, ALICE, "55,555") < 60  # her unsalted scope holds other prompts of hers: never team-a's
    # another tenant sending the same salt: nothing either
    assert cached(server, BOB, "55,555", salt="team-a") == 0


@pytest.mark.slow
def test_another_tenants_answers_do_not_draft_for_a_request(server):
    prompt = "Write the numbers from one to twenty in words, separated by commas."

    def suffix(key: str):
        r = client(server, key).chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0,
            extra_body={"specquant_policy": "suffix"})
        return r.model_extra["specquant"]["accepted"], r.choices[0].message.content

    first, text = suffix(ALICE)
    again, text2 = suffix(ALICE)
    bob, text3 = suffix(BOB)
    assert text == text2 == text3
    assert again >= first + 10, (first, again)  # her own earlier answer drafts for her
    assert bob <= first + 4, (first, again, bob)  # not for Bob: he drafts as she did the first time


@pytest.mark.slow
def test_health_without_a_key_says_only_whether_the_server_lives(server):
    bare = httpx.get(server.url + "/health", timeout=10)
    assert bare.status_code == 200 and bare.json() == {"status": "ok"}
    full = httpx.get(server.url + "/health", headers={"Authorization": f"Bearer {BOB}"}, timeout=10).json()
    assert full["status"] == "ok" and "prompt_cache" in full and "draft_memory" in full
    wrong = httpx.get(server.url + "/health", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.slow
def test_metrics_need_a_key(server):
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
    assert httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ALICE}"}, timeout=10).status_code \
        == 200


@pytest.mark.slow
def test_a_salt_that_is_empty_or_not_text_is_refused(server):
    for salt in ("", 7, "x" * 300):
        with pytest.raises(openai.BadRequestError) as e:
            cached(server, ALICE, "1", salt=salt)
        assert e.value.status_code == 400 and "cache_salt" in str(e.value)


STORY = "Tell me a short story about a lighthouse."


@pytest.fixture(scope="module")
def story_samples(models):
    """Two seeds whose parent samples of STORY (one token a call) lie clear of the batch-shape noise at every token,
    with those samples: whatever shares the batch, each such seed has exactly one answer."""
    return clear_seeds(models["f16"], STORY, 24)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["parent", "suffix", "spec-q4"])
def test_a_seed_gives_its_answer_again_beside_other_requests(server, policy, story_samples):
    """The same seeded requests alone, then four at once beside another tenant's (two slots: other batch shapes):
    each is the parent's own sampled answer for its seed, token for token. (Seeds with a near-tie, where another
    batch shape may flip a sample, are the other sampled tests' concern: here the seeds are clear of it, so a
    changed answer is a seed that did not hold.)"""
    def ask(key: str, seed: int, content: str = STORY):
        r = client(server, key).chat.completions.create(
            model="m", messages=[{"role": "user", "content": content}], max_tokens=24, temperature=0.9, seed=seed,
            extra_body={"specquant_policy": policy})
        return r.choices[0].message.content

    s1, s2 = story_samples
    alone = {seed: ask(ALICE, seed) for seed in (s1, s2)}
    with ThreadPoolExecutor(6) as pool:
        mine = [pool.submit(ask, ALICE, s) for s in (s1, s2, s1, s2)]
        theirs = [pool.submit(ask, BOB, s, "Describe a harbour at night.") for s in (1, 2)]
        busy = [f.result() for f in mine]
        [f.result() for f in theirs]
    pairs = [*zip(busy, (s1, s2, s1, s2)), (alone[s1], s1), (alone[s2], s2)]
    verdicts = [sampled_verdict(text, story_samples[seed]) for text, seed in pairs]
    assert set(verdicts) == {"identical"}, (verdicts, busy, alone)


@pytest.mark.slow
def test_the_cache_folder_stays_private_and_within_its_budget_across_restarts(family_dir, tmp_path):
    import stat

    folder = tmp_path / "cache"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    sizes = []
    for restart in range(3):
        s = ServerProc(["--family", str(family_dir), "--parallel", "1", "--policies", "parent", "--policy", "parent",
                        "--api-key", ALICE, "--cache-dir", str(folder), "--cache-ram", "64", "--cache-disk", "8"])
        try:
            for k in range(4):  # each prompt reuses the slot: the one before goes to the cache, and its folder
                cached(s, ALICE, f"{restart}{k},000", question=f"Question {restart}.{k}: how long is a shift?")
        finally:
            s.stop()
        files = list(folder.glob("*.sqpc"))
        sizes.append(sum(f.stat().st_size for f in files))
        assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
        if restart == 0:
            assert "made it private" in s.log()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert max(sizes) <= 8 << 20, sizes
