"""Activation statistics through llama.cpp's eval callback, imatrix and graded draft variants, on a copy of
the demo family (hard links: the F16 is not copied)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from specquant_cli.family import grade
from specquant_cli.family.activations import CALIBRATION_SET, chunks_of
from specquant_cli.family.grade import GradePlan, TensorCost
from specquant_cli.family.imatrix import MIN_ROWS, weight_name
from specquant_cli.routing.auto import MODEL_MARGIN

from conftest import run_cli

PROMPT = "Write a Python function that returns the factorial of n."


# -- units (no model) -------------------------------------------------------------------------------------
def test_weight_name_and_chunks():
    assert weight_name(b"blk.3.attn_q.weight") == "blk.3.attn_q.weight"
    assert weight_name(b"CUDA0#blk.3.ffn_up.weight#0") == "blk.3.ffn_up.weight"
    chunks = chunks_of(list(range(100)), 32, 90, bos=7)
    assert [len(c) for c in chunks] == [32, 32, 29] and all(c[0] == 7 for c in chunks)
    assert chunks[1][1] == 31  # 31 text tokens per chunk after BOS
    assert chunks_of(list(range(40)), 32, 1000, bos=None) == [list(range(32))]  # an 8-token tail says too little
    assert MIN_ROWS == 16


def test_allocate_respects_budget_and_upgrades_the_sensitive_first():
    costs = [TensorCost(f"blk.{i}.ffn_down.weight", 1000, 256,
                        {"q2_k": 0.1 * (i + 1), "q3_k": 0.04 * (i + 1), "q4_0": 0.01 * (i + 1), "q8_0": 0.0001})
             for i in range(4)]
    bits = {t: grade.type_bits(t) for t in ("q2_k", "q3_k", "q4_0", "q8_0")}
    budget = 4000 * bits["q2_k"] + 1000 * (bits["q4_0"] - bits["q2_k"]) * 2
    level = grade.allocate(costs, budget)
    used = sum(1000 * bits[level[c.name]] for c in costs)
    assert used <= budget
    # the most sensitive tensor (largest errors) gets at least the type of the least sensitive one
    assert bits[level["blk.3.ffn_down.weight"]] >= bits[level["blk.0.ffn_down.weight"]]
    assert level["blk.3.ffn_down.weight"] != "q2_k"


def test_overrides_group_layers_into_one_regex_per_kind_and_type():
    import re

    types = {"blk.0.attn_q.weight": "q4_0", "blk.10.attn_q.weight": "q4_0", "blk.1.attn_q.weight": "q8_0",
             "token_embd.weight": "q5_0"}
    p = GradePlan(3.5, 3.5, 2.0, 8.0, 1, types, [], 0.0)
    pats = p.overrides()
    assert len(pats) == 3
    for name, t in types.items():
        hits = [q for pat, q in pats if re.search(pat, name)]
        assert hits == [t], name
    assert not any(re.search(pat, "blk.100.attn_q.weight") for pat, _ in pats)


def test_split_types_names_recipes_and_grade():
    from specquant_cli.errors import InputError
    from specquant_cli.family.recipes import split_types

    plain, rs = split_types("q4_0,q8_0,q4i,q3g")
    assert plain == ["q4_0", "q8_0"] and [r.role for r in rs] == ["q4i", "q3g"] and rs[1].grade == 3.5
    plain, rs = split_types("q4_0", grade=3.2)
    assert plain == [] and rs[0].role == "q3g32" and rs[0].imatrix and rs[0].base == "q4_0"
    with pytest.raises(InputError):
        split_types("q4_k_m,q8_0", grade=3.5)
    with pytest.raises(InputError):
        split_types("q4_0", grade=3.5, role="q8_0")
    with pytest.raises(InputError):
        split_types("q4_0", role="x")


# -- the demo family ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fam(family_dir, tmp_path_factory):
    """A copy of the demo family (hard links), calibrated and with q4i and a graded variant added."""
    root = tmp_path_factory.mktemp("drafts")
    m = json.loads((family_dir / "manifest.json").read_text())
    for v in m["variants"].values():
        try:
            os.link(family_dir / v["path"], root / v["path"])
        except OSError:
            shutil.copyfile(family_dir / v["path"], root / v["path"])
    (root / "manifest.json").write_text(json.dumps(m))
    r = run_cli(["calibrate-activations", "--family", str(root), "--tokens", "256", "--chunk", "128", "--json"])
    assert r.exit_code == 0, r.stderr
    base = root / m["variants"]["f16"]["path"]
    r = run_cli(["quantize", str(base), "--out", str(root), "--types", "q4i"])
    assert r.exit_code == 0, r.stderr
    # graded into the q3g role: the demo model's 576-wide rows allow only 32-blocks, so ~3.5 is out of its reach
    r = run_cli(["quantize", str(base), "--out", str(root), "--types", "q4_0", "--grade", "4.8", "--role", "q3g",
                 "--ladder", "q3_k,q4_0,q8_0", "--json"])
    assert r.exit_code == 0, r.stderr
    return root, json.loads(r.stdout)


def test_callback_collects_every_weight_with_its_channel_count(fam):
    import gguf

    from specquant_cli.family.imatrix import ActivationStats

    root, manifest = fam
    rec = manifest["imatrix"]
    assert rec["calibration"]["sha256"] == hashlib.sha256(CALIBRATION_SET.read_bytes()).hexdigest()
    assert rec["tokens"] == 256 and rec["chunks"] == 2
    st = ActivationStats.load(root / rec["file"])
    base = gguf.GGUFReader(root / manifest["variants"]["f16"]["path"])
    mats = {t.name: int(t.shape[0]) for t in base.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    n_layer = manifest["hparams"]["block_count"]
    assert len(mats) == 7 * n_layer
    # every weight matrix of every layer, plus the (tied) output projection
    assert set(st.sums) == set(mats) | {"token_embd.weight"}
    for name, n_in in mats.items():
        assert st.sums[name].shape == (1, n_in), name
        assert st.counts[name].tolist() == [256.0], name
    assert st.sums["token_embd.weight"].shape == (1, manifest["hparams"]["embedding_length"])
    means = st.mean()
    assert all(np.isfinite(v).all() and (v >= 0).all() and v.max() > 0 for v in means.values())
    # q, k and v read the same normalized input
    assert np.allclose(means["blk.0.attn_q.weight"], means["blk.0.attn_k.weight"])


def test_imatrix_and_graded_variants_are_roles_that_load(fam):
    from specquant_cli.backend.llama import Context, Model
    from specquant_cli.family.manifest import Family

    root, manifest = fam
    f = Family.load(root)
    assert {"q4", "q8", "parent", "q4i", "q3g"} <= set(f.roles())
    assert f.verify(hashes=False) == []
    q4i, q3g = f.variant("q4i"), f.variant("q3g")
    assert q4i["type"] == "q4_0+imatrix" and q4i["imatrix"]["sha256"] == manifest["imatrix"]["sha256"]
    assert q3g["grade"]["target_bpw"] == 4.8
    # the requested average bits per weight, within tolerance, as the file holds it
    got = grade.tensor_bpw(f.path("q3g"))
    assert 4.8 - 0.05 <= got <= 4.8 + 0.005, got
    assert q3g["tensor_bits_per_weight"] == round(got, 3)
    types = set(grade.tensor_types(f.path("q3g")).values())
    assert {"q3_k", "q4_0", "q8_0"} <= types
    assert "have importance matrix data" in (root / "quantize.log").read_text()
    assert (root / q3g["grade"]["plan_file"]).is_file()
    for role in ("q4i", "q3g"):
        m = Model(f.path(role))
        ctx = Context(m, n_ctx=128)
        ctx.decode(m.tokenize("The capital of France is", add_bos=True), logits="last")
        assert np.isfinite(ctx.logits(-1)).all()
        ctx.close()
        m.close()


def test_spec_policies_over_new_roles_are_greedy_identical_to_parent(fam):
    from specquant_cli.decoding.sampling import SamplingParams
    from specquant_cli.family.manifest import Family
    from specquant_cli.routing.router import Router
    from specquant_cli.runtime import Runtime
    from specquant_cli.session import ChatSession

    root, _ = fam
    rt = Runtime.open(Family.load(root), n_ctx=1024)
    texts = {}
    try:
        for policy in ("parent", "spec-q4i"):
            answer, recs = ChatSession(rt, Router(None, rt.count_tokens), policy, SamplingParams(), 24).ask(PROMPT)
            list(recs)
            texts[policy] = answer.text
            assert policy == "parent" or answer.last.drafted > 0
    finally:
        rt.close()
    # and through the command, in a process of its own
    r = run_cli(["chat", "--family", str(root), "--policy", "spec-q3g", "--max-tokens", "24", "--json", PROMPT])
    assert r.exit_code == 0, r.stderr
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["stats"]["drafted"] > 0 and rec["route"]["plan"] == "q3g drafts, parent verifies"
    assert texts["spec-q4i"] == texts["parent"] and rec["text"] == texts["parent"]


def test_auto_measures_and_picks_recipe_drafts(fam, family_dir):
    """Calibration measures every draft role the family has, again when the family gains one, and auto can
    run a recipe draft (greedy output still the parent's)."""
    root, _ = fam
    r = run_cli(["calibrate", "--family", str(family_dir), "--json"])  # the demo family: before q4i and q3g
    assert r.exit_code == 0, r.stderr
    path = root / "calibration.json"
    shutil.copyfile(family_dir / "calibration.json", path)  # this copy's costs as measured before it gained them
    before = json.loads(path.read_text())
    r = run_cli(["calibrate", "--family", str(root), "--json"])  # no --force: the missing roles are reason enough
    assert r.exit_code == 0, r.stderr
    assert {"q4", "q8", "q4i", "q3g"} <= set(json.loads(r.stdout)["draft_step_s"])
    after = json.loads(path.read_text())
    (key,) = [k for k in after if after[k] != before.get(k)]  # this machine's entry, measured again
    assert {"q4i", "q3g"}.isdisjoint(before[key]["draft_step_s"]) and "q4" in before[key]["draft_step_s"]
    assert after[key]["parent_call_s"] != before[key]["parent_call_s"]  # measured anew, not merged into the old
    # make q3g look nearly free, so auto's choice is forced onto it
    data = json.loads(path.read_text())
    entry = data[key]
    entry["draft_step_s"]["q3g"] = entry["draft_pair_s"]["q3g"] = entry["parent_call_s"]["1"] / 50
    entry["tokens_per_cycle"]["q3g"] = entry["tokens_per_cycle"]["q4"]
    path.write_text(json.dumps(data))
    route = json.loads(run_cli(["route", "--json", "--family", str(root), PROMPT]).stdout)["plan"]
    names = [c["plan"] for c in route["candidates"]]
    predicted = {c["plan"]: c["predicted_speedup"] for c in route["candidates"]}
    # each draft in its two-level form (its batch curve is measured), alone, and mixed with suffix drafts where it
    # clears its margin alone (a draft that barely pays is not mixed in: this CPU's costs decide for q4i)
    assert {"stacked-q4i", "stacked-q3g", "suffix+stacked-q3g"} <= set(names)
    assert ("suffix+stacked-q4i" in names) == (predicted["stacked-q4i"] >= MODEL_MARGIN)
    assert route["draft"] in ("stacked-q3g", "suffix+stacked-q3g"), route
    args = ["chat", "--family", str(root), "--max-tokens", "24", "--json", PROMPT]
    parent = json.loads(run_cli(args + ["--policy", "parent"]).stdout.strip().splitlines()[-1])
    r = run_cli(args + ["--policy", "auto"])
    assert r.exit_code == 0, r.stderr
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["route"]["plan"].startswith(("stacked-q3g drafts", "suffix+stacked-q3g drafts"))
    assert rec["stats"]["drafted"] > 0
    assert rec["text"] == parent["text"]


def test_a_custom_graded_role_drafts_through_its_spec_policy(fam):
    root, manifest = fam
    base = root / manifest["variants"]["f16"]["path"]
    r = run_cli(["quantize", str(base), "--out", str(root), "--types", "q4_0", "--grade", "4.6", "--role", "mine",
                 "--ladder", "q3_k,q4_0,q8_0"])
    assert r.exit_code == 0, r.stderr
    args = ["chat", "--family", str(root), "--max-tokens", "24", "--json", PROMPT]
    parent = json.loads(run_cli(args + ["--policy", "parent"]).stdout.strip().splitlines()[-1])
    r = run_cli(args + ["--policy", "spec-mine"])
    assert r.exit_code == 0, r.stderr
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["route"]["plan"] == "mine drafts, parent verifies" and rec["stats"]["drafted"] > 0
    assert rec["text"] == parent["text"]
    r = run_cli(["chat", "--family", str(root), "--policy", "spec-absent", "hi"])
    assert r.exit_code != 0 and "Traceback" not in r.stderr
    assert "no 'absent' variant" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_grade_out_of_reach_is_a_clean_error(fam):
    root, manifest = fam
    r = run_cli(["quantize", str(root / manifest["variants"]["f16"]["path"]), "--out", str(root), "--types", "q4_0",
                 "--grade", "2.0"])
    assert r.exit_code == 1 and "below what this ladder reaches" in r.stderr


# -- a tiny untied model (no forward pass): the plan reaches the file exactly -----------------------------
def _tiny_untied(path, dim=256, ff=512, layers=2, vocab=512):
    """hostile_util's tiny llama with layers of growing magnitude; returns each graded matrix's input width."""
    from hostile_util import tiny_llama

    tiny_llama(path, dim=dim, ff=ff, layers=layers, vocab=vocab, layer_gain=2.0)
    widths = {"attn_q": dim, "attn_k": dim, "attn_v": dim, "attn_output": dim, "ffn_gate": dim, "ffn_up": dim,
              "ffn_down": ff}
    return {f"blk.{i}.{n}.weight": w for i in range(layers) for n, w in widths.items()} | {"output.weight": dim}


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_graded_variant_of_an_untied_model_matches_its_plan(tmp_path):
    from specquant_cli.family.imatrix import IMATRIX_FILE, ActivationStats
    from specquant_cli.family.recipes import add_variants, split_types
    from specquant_cli.fsutil import sha256_file

    base = tmp_path / "tiny-f16.gguf"
    cols = _tiny_untied(base)
    rng = np.random.default_rng(1)
    st = ActivationStats(chunks=1, chunk_size=64, tokens=64)
    for name, n in cols.items():  # made-up statistics: a few loud channels per matrix
        st.sums[name] = (rng.gamma(0.5, 1.0, (1, n)) * 64).astype(np.float64)
        st.counts[name] = np.array([64.0])
    st.save(tmp_path / IMATRIX_FILE, {"source": "test"})
    size, sha = base.stat().st_size, sha256_file(base)
    (tmp_path / "manifest.json").write_text(json.dumps({
        "schema": 1, "family": "tiny", "architecture": "llama", "hparams": {},
        "base": {"file": base.name, "sha256": sha, "size_bytes": size, "type": "F16"},
        "roles": {"f16": "f16"},
        "variants": {"f16": {"type": "f16", "role": "f16", "path": base.name, "size_bytes": size, "sha256": sha}},
        "imatrix": {"file": IMATRIX_FILE, "sha256": sha256_file(tmp_path / IMATRIX_FILE), "base_sha256": sha}}))
    _, recipes = split_types("q4_0", grade=3.2, role="t3g")
    m = add_variants(tmp_path, recipes)
    v = m["variants"]["t3g"]
    plan = json.loads((tmp_path / v["grade"]["plan_file"]).read_text())
    got = grade.tensor_types(tmp_path / v["path"])
    # every planned type is in the file: llama.cpp's own mixture rules did not move any tensor
    assert {n: t["type"] for n, t in plan["tensors"].items()} == {n: got[n] for n in plan["tensors"]}
    # the looked-up embeddings are graded too (uniform channel weights), not left at the base type
    assert "token_embd.weight" in plan["tensors"] and "output.weight" in plan["tensors"]
    assert 3.2 - 0.1 <= grade.tensor_bpw(tmp_path / v["path"]) <= 3.2 + 1e-6
    assert m["roles"]["t3g"] == "graded-3.2bpw" and m["roles"]["f16"] == "f16"
