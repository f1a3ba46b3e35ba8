"""Zero-prefill sibling drafts: the draft imports the parent's KV cache instead of decoding the prompt."""

import json

import pytest

from specquant_cli.backend.llama import Context
from specquant_cli.decoding.drafters import ModelDrafter
from specquant_cli.decoding.engine import Engine
from specquant_cli.decoding.gamma import FixedGamma
from specquant_cli.decoding.stream import generate_text

from conftest import run_cli

PROMPTS = ["Write a haiku about the sea.", "List three prime numbers and explain why each is prime."]


class Counting(Context):
    """A real context that counts the tokens it decodes."""

    decoded = 0

    def decode(self, tokens, logits="last"):
        self.decoded += len(tokens)
        super().decode(tokens, logits)


@pytest.fixture(scope="module")
def ctxs(models):
    return {"f16": Context(models["f16"], 2048), "q4": Counting(models["q4"], 2048)}


def _prompt(models, text):
    return models["f16"].chat_prompt([{"role": "user", "content": text}])


@pytest.mark.parametrize("text", PROMPTS)
def test_import_keeps_output_identical_and_skips_the_draft_prefill(ctxs, models, text):
    prompt = _prompt(models, text)
    ctxs["f16"].reset()
    ref, _, _ = generate_text(Engine(ctxs["f16"]), prompt, 40)
    for parent in (ctxs["f16"], None):  # with and without the import
        ctxs["f16"].reset()
        ctxs["q4"].reset()
        ctxs["q4"].decoded = 0
        d = ModelDrafter(ctxs["q4"], "q4", parent=parent)
        eng = Engine(ctxs["f16"], d, FixedGamma(4))
        text_out, _, last = generate_text(eng, prompt, 40)
        assert text_out == ref
        if parent is not None:
            assert last.kv_import is True and eng.stats.kv_import_s > 0
        else:
            assert last.kv_import is False
    # the preparation alone: with the import the draft decodes only the prompt's last token
    for parent, want in ((ctxs["f16"], 1), (None, len(prompt))):
        ctxs["f16"].reset()
        ctxs["q4"].reset()
        ctxs["f16"].sync(prompt[:-1], logits="none")
        ctxs["q4"].decoded = 0
        ModelDrafter(ctxs["q4"], "q4", parent=parent).prepare(prompt)
        assert ctxs["q4"].decoded == want and ctxs["q4"].tokens == prompt


def test_a_refused_import_falls_back_to_the_draft_prefill(ctxs, models):
    class Garbled:
        """A parent whose exported state is not a KV cache llama.cpp will take."""

        def __init__(self, real):
            self.real, self.tokens = real, real.tokens

        def export_state(self):
            buf, n = self.real.export_state()
            for i in range(min(n, 64)):
                buf[i] = 0xFF
            return buf, n

    prompt = _prompt(models, PROMPTS[0])
    ctxs["f16"].reset()
    ref, _, _ = generate_text(Engine(ctxs["f16"]), prompt, 24)
    ctxs["f16"].reset()
    ctxs["q4"].reset()
    eng = Engine(ctxs["f16"], None, FixedGamma(4))
    d = ModelDrafter(ctxs["q4"], "q4")
    eng.drafter = d
    d.parent = Garbled(ctxs["f16"])
    text_out, _, last = generate_text(eng, prompt, 24)
    assert text_out == ref and last.kv_import is False and d.import_ok is False
    assert eng.stats.draft_prefill_s > 0 and ctxs["q4"].tokens[:len(prompt)] == prompt


def test_multi_turn_chat_keeps_working_with_import(family_dir):
    """The second turn reuses the prefix cache of the first; stats say whether the draft imported."""
    from specquant_cli.decoding.sampling import SamplingParams
    from specquant_cli.family.manifest import Family
    from specquant_cli.routing.router import Router
    from specquant_cli.runtime import Runtime
    from specquant_cli.session import ChatSession

    rt = Runtime.open(Family.load(family_dir), n_ctx=2048)
    try:
        runs = {}
        for policy in ("parent", "spec-q4"):
            s = ChatSession(rt, Router(None, rt.count_tokens), policy, SamplingParams(), 24)
            texts = []
            for q in ("Name a fruit.", "And a vegetable?"):
                answer, recs = s.ask(q)
                list(recs)
                texts.append(answer.text)
                if policy == "spec-q4":
                    assert answer.last.kv_import is not None
            runs[policy] = texts
        assert runs["spec-q4"] == runs["parent"]
    finally:
        rt.close()


def test_chat_json_reports_the_import(family_dir):
    r = run_cli(["chat", "--family", str(family_dir), "--policy", "spec-q4", "--max-tokens", "16", "--json",
                 "Explain what a prime number is."])
    assert r.exit_code == 0, r.stderr
    st = json.loads(r.stdout)["stats"]
    assert st["kv_import"] is True and st["kv_import_s"] > 0 and st["decode_tokens_per_s"] > st["tokens_per_s"]
