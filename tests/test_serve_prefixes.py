"""Prefill once, through a real `specquant serve` and the `openai` client: a prompt takes the idle slot that holds its
longest prefix (a conversation's next turn, another conversation over the same system prompt); idle slots are parked
in the prompt cache while another request runs; a reused slot's state is kept in the prompt cache and restored for a
later prompt, also by the next server from --cache-dir, and refused by a server of another context size;
--no-prompt-cache prefills every prompt whole. Every greedy answer is the parent's own (or differs at a proven
near-tie); `usage.prompt_tokens_details.cached_tokens` says what was not prefilled."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_serve import KEY, ServerProc

from specquant_cli.bench import fidelity
from specquant_cli.runtime.prefixes import MIN_REUSE

N = 8
SYSTEM = "You are the archivist of a small coastal museum. Answer briefly and plainly. " * 10
QUESTIONS = ("Which ship is the oldest?", "When does the museum open?", "Who founded the museum?",
             "What is in the cellar?")


def conversation(q: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": q}]


def ask(server: ServerProc, messages: list[dict]) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached tokens)."""
    r = server.client().chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=N,
                                                temperature=0)
    u = r.usage.model_dump()
    return r.choices[0].message.content, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def judge(models):
    """verdict(messages, text): the served answer against the parent alone, cold (bench.fidelity's classes)."""
    from specquant_cli.backend.llama import Context

    ctx = Context(models["f16"], 1024)
    bound = fidelity.measure_noise(ctx, 4, 8).bound

    def verdict(messages: list[dict], text: str) -> str:
        return fidelity.judge_text(ctx, ctx.model.chat_prompt(messages), text, N, bound)["verdict"]

    yield verdict
    ctx.close()


def cache_status(server: ServerProc) -> dict:
    return server.health()["prompt_cache"]


@pytest.mark.slow
def test_a_prompt_takes_the_slot_holding_its_longest_prefix_and_idle_slots_are_parked(family_dir, judge):
    """Two slots, a prompt cache: a second conversation over the same system prompt takes the idle slot that holds
    it (the first conversation's state goes to the cache), the first conversation's next turn takes it back from the
    cache, and a request that shares nothing takes the empty slot and parks the idle one: its state to the cache, its
    cells freed (an idle slot's cells would cost every call of the running request), so that conversation's next turn
    is restored from the cache, not from the slot."""
    s = ServerProc(["--family", str(family_dir), "--parallel", "2", "--policy", "parent", "--policies", "parent",
                    "--api-key", KEY, "--cache-ram", "64"])
    try:
        a, b = conversation(QUESTIONS[0]), conversation(QUESTIONS[1])
        text_a, n_a, cached = ask(s, a)
        assert cached == 0
        text_b, n_b, cached_b = ask(s, b)  # slot 0 holds the system prompt: taken, not copied to the empty slot
        st = cache_status(s)
        assert cached_b > 100 and st["copied_tokens"] == 0 and st["entries"] == 1
        a2 = a + [{"role": "assistant", "content": text_a}, {"role": "user", "content": "And the youngest?"}]
        text_a2, n_a2, cached_a2 = ask(s, a2)  # back in slot 0, its first turn restored from the cache
        st = cache_status(s)
        assert cached_a2 >= n_a and st["hits"] == 1 and st["restored_tokens"] > 0
        restored = st["restored_tokens"]
        other = conversation(QUESTIONS[2], "Reply in the voice of a ship's cook who has seen every storm. " * 8)
        text_c, _, cached_c = ask(s, other)  # the empty slot; slot 0 (idle, holding turn 2) is parked
        assert cached_c == 0 and cache_status(s)["restored_tokens"] == restored
        a3 = a2 + [{"role": "assistant", "content": text_a2}, {"role": "user", "content": "Thank you."}]
        text_a3, _, cached_a3 = ask(s, a3)  # turn 2 comes back from the cache: the slot held nothing
        st = cache_status(s)
        assert cached_a3 >= n_a2 and st["restored_tokens"] >= restored + n_a2 - MIN_REUSE
        verdicts = [judge(m, t) for m, t in ((a, text_a), (b, text_b), (a2, text_a2), (other, text_c), (a3, text_a3))]
        assert fidelity.UNEXPLAINED not in verdicts
        families = {f.name: f for f in text_string_to_metric_families(
            httpx.get(s.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text)}
        samples = {x.name: x.value for x in families["specquant_prompt_cache_restored_tokens"].samples}
        assert samples["specquant_prompt_cache_restored_tokens_total"] == st["restored_tokens"]
    finally:
        s.stop()


@pytest.mark.slow
def test_a_reused_slot_is_restored_from_ram_and_by_the_next_server_from_disk(family_dir, judge, tmp_path):
    args = ["--family", str(family_dir), "--parallel", "1", "--policy", "parent", "--policies", "parent",
            "--api-key", KEY, "--cache-ram", "64", "--cache-dir", str(tmp_path)]
    other_system = "Reply in the voice of a ship's cook who has seen every storm of the century. " * 8
    first, other = conversation(QUESTIONS[2]), conversation(QUESTIONS[3], other_system)
    s = ServerProc(args)
    try:
        text, n, _ = ask(s, first)
        ask(s, other)  # the one slot is reused: the first conversation's state goes to the cache
        assert cache_status(s)["entries"] == 1
        again, _, cached = ask(s, first)
        assert again == text and cached == n - 1
        st = cache_status(s)
        assert st["hits"] == 1 and st["restored_tokens"] > n - 1 - MIN_REUSE and st["bytes"] <= st["budget_bytes"]
    finally:
        s.stop()
    s = ServerProc(args)  # a new server reads the folder back
    try:
        assert cache_status(s)["entries"] >= 1
        again, _, cached = ask(s, first)
        assert cached == n - 1 and judge(first, again) != fidelity.UNEXPLAINED
    finally:
        s.stop()
    s = ServerProc([*args, "--ctx", "2048"])  # another context size: its files are refused, with a warning
    try:
        assert cache_status(s)["entries"] == 0
        assert "refused" in s.log()
        _, _, cached = ask(s, first)
        assert cached == 0
    finally:
        s.stop()


@pytest.mark.slow
def test_no_prompt_cache_prefills_every_prompt_whole(family_dir):
    s = ServerProc(["--family", str(family_dir), "--parallel", "2", "--policy", "parent", "--policies", "parent",
                    "--api-key", KEY, "--no-prompt-cache"])
    try:
        m = conversation(QUESTIONS[0])
        first = ask(s, m)
        second = ask(s, m)
        assert first[2] == second[2] == 0 and first[0] == second[0]
        st = cache_status(s)
        assert st["enabled"] is False and st["copied_tokens"] == 0
    finally:
        s.stop()


def test_the_memory_check_counts_the_prompt_cache_and_a_bad_cache_dir_is_one_line(family_dir, tmp_path):
    import subprocess
    import sys

    from test_serve import REPO

    def serve(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "specquant_cli", "serve", "--port", "0", "--family",
                               str(family_dir), "--parallel", "1", "--policies", "parent", "--policy", "parent",
                               *extra], cwd=REPO, capture_output=True, text=True, timeout=120)

    r = serve("--cache-ram", str(1 << 22))  # 4 TiB
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--cache-ram" in r.stderr and "prompt cache" in r.stderr
    (tmp_path / "file").write_text("x")
    r = serve("--cache-dir", str(tmp_path / "file"))
    assert r.returncode != 0 and "--cache-dir" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = serve("--cache-dir", str(family_dir))  # never into a family folder
    assert r.returncode != 0 and "family folder" in r.stderr and "Traceback" not in r.stderr
    assert not list(family_dir.glob("*.sqpc"))


@pytest.mark.slow
def test_a_request_cancelled_during_its_prefill_stops_between_chunks(family_dir):
    s = ServerProc(["--family", str(family_dir), "--parallel", "2", "--policy", "parent", "--policies", "parent",
                    "--api-key", KEY, "--ctx", "8192", "--prefill-chunk", "16"])
    try:
        long = conversation("Summarize the rules.", SYSTEM * 9)
        body = {"model": "smollm2-135m", "messages": long, "max_tokens": 4, "temperature": 0}
        with pytest.raises(httpx.TimeoutException):  # the client leaves while the prompt is being prefilled
            httpx.post(s.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=0.5)
        from test_serve import wait_for

        assert wait_for(lambda: s.health()["running"] == 0, timeout=20)
        _, n, cached = ask(s, long)  # the same prompt again: only what the cancelled prefill got to is there
        assert 0 < cached < n - 1 - 16
        assert s.health()["cancelled"] == 1
    finally:
        s.stop()
