"""Shared fixtures: the real demo family, isolated user paths, a fixed terminal width."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FAMILY_DIR = REPO / "models" / "smollm2-135m"


PINNED_PARENT = "f16"  # the parent's rendering every test runs with unless it sets its own (see _isolate)


def pytest_configure(config):
    """Under pytest-xdist (scripts/test.sh runs `-n` one worker per core), each worker runs on a core of its own:
    every count of "every core" in it (settings.cores: its CPU affinity) is then its share, so no two workers' llama.cpp
    threads spin on one core, and the processes it starts (servers, self-test children) inherit the share."""
    import os

    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()) or \
            not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = [c for k, c in enumerate(cpus) if k % int(count) == int(worker[2:]) % int(count)]
    os.sched_setaffinity(0, share or cpus)


@pytest.fixture(scope="session", autouse=True)
def selftest_cache(tmp_path_factory) -> Iterator[Path]:
    """One XDG cache for the session, holding the llama.cpp build's self-test result: the suite runs the
    self-test first (child processes) and stops with its one-line reason on a CPU where the build cannot
    run, instead of dying of a signal mid-suite."""
    import os

    from specquant_cli.backend import selftest

    cache = tmp_path_factory.mktemp("xdg-cache")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)  # for the session fixtures too (set up before _isolate)
    old_data = os.environ.get("XDG_DATA_HOME")
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("xdg-data"))  # their models folder (family.store)
    os.environ["SPECQUANT_PARENT"] = PINNED_PARENT  # and the module fixtures' servers and commands (see _isolate)
    r = selftest.run()
    if not r.ok:
        pytest.exit(f"llama.cpp self-test failed: {r.error}", returncode=1)
    yield cache
    for name, value in (("XDG_CACHE_HOME", old), ("XDG_DATA_HOME", old_data)):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module", autouse=True)
def _module_models(tmp_path_factory, selftest_cache) -> Iterator[None]:
    """Each test module's own models folder for its module fixtures: a family one module makes (by a name such as
    `fam`) is no other module's, whichever worker runs them one after another (a taken name is refused)."""
    import os

    old = os.environ.get("XDG_DATA_HOME")
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("xdg-data-module"))
    yield
    if old is None:
        os.environ.pop("XDG_DATA_HOME", None)
    else:
        os.environ["XDG_DATA_HOME"] = old


@pytest.fixture(autouse=True)
def _isolate(monkeypatch, tmp_path_factory, selftest_cache):
    monkeypatch.setenv("XDG_CACHE_HOME", str(selftest_cache))
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("TERM", "dumb")
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
    # each test's own models folder (family.store): what one pulls or quantizes is no other's default family
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
    from specquant_cli.settings import settings_table

    for s in settings_table().values():  # a developer's SPECQUANT_* settings do not reach the tests
        monkeypatch.delenv(s.env, raising=False)
    # Which rendering `auto` makes the parent depends on this machine's CPU and calibration: pinned to F16 (what a
    # family opened without a session serves too); the tests of the choice set it themselves.
    monkeypatch.setenv("SPECQUANT_PARENT", PINNED_PARENT)
    from specquant_cli.settings import environment

    environment._resolved_debug.clear()  # what an earlier in-process command resolved
    environment._resolved_models.clear()


@pytest.fixture(autouse=True)
def _registries() -> Iterator[None]:
    """Every test leaves the drafter and policy tables as it found them (a test that registers a drafter, a
    policy or a family's role drafters adds rows only for itself)."""
    from specquant_cli.decoding.registry import DRAFTERS
    from specquant_cli.routing.policies import POLICIES

    drafters, policies = dict(DRAFTERS), dict(POLICIES)
    yield
    for table, before in ((DRAFTERS, drafters), (POLICIES, policies)):
        table.clear()
        table.update(before)


@pytest.fixture(scope="session")
def family_dir() -> Path:
    """The real smollm2-135m family (scripts/test.sh fetches it; fetched here if missing)."""
    from specquant_cli.family.fetch import pull

    fam, _ = pull("smollm2-135m", REPO / "models")
    return fam.root


@pytest.fixture(scope="session")
def family(family_dir):
    from specquant_cli.family.manifest import Family

    return Family.load(family_dir)


@pytest.fixture(scope="session")
def models(family):
    """One loaded llama.cpp Model per role, shared by the whole session."""
    from specquant_cli.backend.llama import Model

    return {role: Model(family.path(role)) for role in ("f16", "q8", "q4")}


@pytest.fixture(scope="session")
def parent_judge(models):
    """verdict(prompt, text, max_tokens): a served greedy answer against the parent's own (one token per call):
    identical, a proven near-tie (bench.fidelity: the parent's top two within the measured batch-vs-single
    noise where they part) or unexplained. Answers of requests decoded together may differ at a near-tie."""
    from specquant_cli.backend.llama import Context
    from specquant_cli.bench import fidelity

    ctx = Context(models["f16"], 1024)
    bound = fidelity.measure_noise(ctx, 4, 8).bound

    def verdict(prompt: str, text: str, max_tokens: int) -> str:
        p = ctx.model.chat_prompt([{"role": "user", "content": prompt}])
        return fidelity.judge_text(ctx, p, text, max_tokens, bound)["verdict"]

    yield verdict
    ctx.close()


SAMPLED_NOISE = 0.02  # log units: a sample whose perturbed score leads the next by less may flip with the batch's shape


def own_samples(model, content: str, seed: int, n: int, temperature: float = 0.9) -> tuple[list[str], list[float]]:
    """The parent's own seeded samples of a one-message chat, one token a call (no batch), with each one's margin:
    how far its perturbed score (Gumbel-max) lies above the next candidate's."""
    import numpy as np

    from specquant_cli.backend.llama import Context
    from specquant_cli.decoding.sampling import Noise, SamplingParams, probs, sample_margin

    ctx = Context(model, 1024, n_threads=1)
    sp, noise = SamplingParams(temperature=temperature, seed=seed), Noise(seed)
    seq = model.chat_prompt([{"role": "user", "content": content}])
    ctx.sync(seq[:-1], logits="none")
    pieces, margins = [], []
    for _ in range(n):
        ctx.decode([seq[-1]], logits="last")
        p = probs(np.array(ctx.logits(-1)), sp)
        t, margin = sample_margin(p, noise.at(len(seq), p.shape[0]))
        margins.append(margin)
        pieces.append(model.piece(t).decode("utf-8", "replace"))
        seq.append(t)
        if t in model.eog_ids:
            break
    ctx.close()
    return pieces, margins


def clear_seeds(model, content: str, n: int, count: int = 2, candidates=range(1, 61)) -> dict:
    """The first `count` seeds whose own samples (own_samples) lead their next candidate by at least twice
    SAMPLED_NOISE at every token: no batch shape may flip any of them, so each must give its answer exactly."""
    found = {}
    for seed in candidates:
        samples = own_samples(model, content, seed, n)
        if min(samples[1]) >= 2 * SAMPLED_NOISE:
            found[seed] = samples
            if len(found) == count:
                return found
    raise AssertionError(f"only {len(found)} of {len(candidates)} seeds sample {content!r} clear of the noise")


def sampled_verdict(text: str, samples) -> str:
    """identical: the parent's own samples (own_samples); near-tie: they part where the parent's sample led the next
    candidate by less than SAMPLED_NOISE (another batch shape's logits may put the other one ahead); else
    unexplained."""
    pieces, margins = samples
    shown = ""
    for piece, margin in zip(pieces, margins):
        if not text.startswith(shown + piece):
            return "near-tie" if margin < SAMPLED_NOISE else "unexplained"
        shown += piece
    return "identical" if text.rstrip() == shown.rstrip() or text.startswith(shown) else "unexplained"


def run_cli(args, input=None, env=None):
    """The CLI in this process, as a command of its own: what the command edge resolves for the process (debug, the
    models folder, the deterministic mode) is taken back after it, as a process's ends with it (a `--deterministic`
    left set would change every later test's calibration fingerprint)."""
    from typer.testing import CliRunner

    from specquant_cli.cli import app
    from specquant_cli.settings import environment

    held = [environment._resolved_debug, environment._resolved_models, environment._resolved_deterministic]
    saved = [list(h) for h in held]
    try:
        return CliRunner().invoke(app, args, input=input, env=env, catch_exceptions=False)
    finally:
        for h, was in zip(held, saved):
            h[:] = was


REAL_MODEL_FIXTURES = {"family_dir", "family", "models"}


def pytest_collection_modifyitems(config, items):
    """Tests that use the real demo family are `slow` (so `-m "not slow"` is a seconds-long loop)."""
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
