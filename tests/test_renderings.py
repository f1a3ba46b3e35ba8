"""The parent's renderings: a BF16 base kept BF16, its F16 rendering made only when exact, the parent this
machine computes fastest chosen once per session, and both renderings serving the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hostile_util import assert_clean_error, cli, tiny_llama

from specquant_cli.family import gguf_read, gguf_write
from specquant_cli.family.manifest import Family
from specquant_cli.family.roles import PARENT_ROLE
from specquant_cli.system import renderings
from specquant_cli.system.hardware import Facts


def _values(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF as float32 values."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1) for t in r.tensors}


def _bf16_base(tmp_path: Path, name: str = "base-bf16.gguf") -> Path:
    src = tiny_llama(tmp_path / "tiny-f16.gguf", layers=2)
    dst = tmp_path / name
    gguf_write.dequantize_to_float(src, dst, "test base", "bf16")
    return dst


def _poison(path: Path, value_bits: int = 0x33D6) -> str:
    """One weight of the BF16 file set to a value F16 cannot hold exactly (0x33D6: about 1e-7); its tensor's name."""
    import gguf

    r = gguf.GGUFReader(str(path), "r+")
    t = next(t for t in r.tensors if t.tensor_type == gguf.GGMLQuantizationType.BF16 and "blk.1" in t.name)
    t.data.reshape(-1).view(np.uint16)[3] = value_bits
    r.data.flush()
    return t.name


# -- the numbers ------------------------------------------------------------------------------------------
def test_values_on_both_grids_are_exact_in_both_formats():
    x = np.array([0.1, -3.14159, 1e-7, 6e-5, 1e-4, 300.7, 0.0, -2.5e-6], dtype=np.float32)
    bits = gguf_write.on_both_grids(x)
    v = gguf_write.bf16_values(bits)
    assert np.array_equal(v.astype(np.float16).astype(np.float32), v)  # exact in F16
    assert np.array_equal(gguf_write.bf16_bits(v), bits)  # and in BF16
    assert np.allclose(v, x, rtol=2 ** -8, atol=2 ** -24)


def test_bf16_rounding_is_to_nearest_even():
    one = np.float32(1.0)
    ulp = np.float32(2 ** -7)
    x = np.array([one + ulp / 2, one + 3 * ulp / 2, one + ulp / 4], dtype=np.float32)
    assert list(gguf_write.bf16_values(gguf_write.bf16_bits(x))) == [1.0, 1.0 + 2 * ulp, 1.0]


def test_the_f16_rendering_of_a_bf16_file_holds_the_same_weights(tmp_path):
    base = _bf16_base(tmp_path)
    out = tmp_path / "f16.gguf"
    gguf_write.f16_of_bf16(base, out, "test")
    info = gguf_read.read_info(out)
    assert info.weight_type == "F16" and info.file_type == "F16" and info.provenance == "test"
    a, b = _values(base), _values(out)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_weight_f16_cannot_hold_makes_no_f16_rendering(tmp_path):
    base = _bf16_base(tmp_path)
    name = _poison(base)
    with pytest.raises(gguf_write.NotExact, match=rf"tensor {name}: 1 of \d+ weights are outside F16's range"):
        gguf_write.f16_of_bf16(base, tmp_path / "f16.gguf", "test")


# -- quantize ---------------------------------------------------------------------------------------------
def test_quantize_keeps_a_bf16_base_and_adds_its_exact_f16_rendering(tmp_path):
    base = _bf16_base(tmp_path)
    r = cli(["quantize", base, "--out", tmp_path / "fam", "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    fam = Family.load(tmp_path / "fam")
    assert set(fam.stored_roles()) == {"f16", "bf16", "q4", "q8"} and fam.roles() == [PARENT_ROLE, "q4", "q8"]
    assert fam.manifest["base"]["type"] == "BF16" and fam.manifest["base"]["file"] == base.name
    assert fam.variant("bf16")["sha256"] == fam.manifest["base"]["sha256"]  # the base itself, placed
    a, b = _values(fam.path("bf16")), _values(fam.path("f16"))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert gguf_read.read_info(fam.path("q4")).weight_type != "BF16"
    assert fam.check(hashes=True, deep=True) == {r: None for r in fam.stored_roles()}


def test_quantize_of_an_inexact_bf16_base_says_so_and_makes_bf16_only(tmp_path):
    base = _bf16_base(tmp_path)
    name = _poison(base)
    r = cli(["quantize", base, "--out", tmp_path / "fam", "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    assert "warning: no F16 rendering" in r.stderr and name in r.stderr
    fam = Family.load(tmp_path / "fam")
    assert fam.renderings() == ["bf16"] and fam.parent_rendering == "bf16"
    assert not list((tmp_path / "fam").glob("*f16.gguf.part"))
    r = cli(["quantize", base, "--out", tmp_path / "fam2", "--types", "f16,bf16", "--threads", "1"])
    assert_clean_error(r, 1, "--types f16", name, "none is made")
    assert not (tmp_path / "fam2" / "manifest.json").exists()


def test_an_f16_base_is_never_rounded_to_bf16(tmp_path):
    base = tiny_llama(tmp_path / "base-f16.gguf")
    r = cli(["quantize", base, "--out", tmp_path / "fam", "--types", "q8_0,f16,bf16", "--threads", "1"])
    assert_clean_error(r, 2 if r.exit_code == 2 else 1, "--types bf16", "is F16", "never rounded")
    assert not (tmp_path / "fam").exists() or not (tmp_path / "fam" / "manifest.json").exists()
    r = cli(["quantize", base, "--out", tmp_path / "fam", "--threads", "1"])  # the default: F16 stays F16 only
    assert r.exit_code == 0, r.stderr
    assert Family.load(tmp_path / "fam").renderings() == ["f16"]


# -- the choice -------------------------------------------------------------------------------------------
def _facts(bf16: bool) -> Facts:
    return Facts(gpus=[], gpu_status="none", ram_total=8 << 30, ram_available=8 << 30, cores_physical=2,
                 cores_logical=2, cpu_flags={"avx512_bf16": bf16}, gpu_offload=False,
                 build={"cpu_features": ["AVX2", *(["AVX512_BF16"] if bf16 else [])]})


def _manifest_family(tmp_path, roles) -> Family:
    return Family(tmp_path, {"family": "t", "variants": {r: {"path": f"{r}.gguf"} for r in roles}})


def test_the_choice_follows_the_request_the_family_and_the_cpu(tmp_path):
    both = _manifest_family(tmp_path, ["f16", "bf16", "q4"])
    assert renderings.decide(both, "f16", _facts(True)).rendering == "f16"
    assert renderings.decide(both, "bf16", _facts(False)).source == "flag"
    only = _manifest_family(tmp_path, ["bf16", "q4"])
    assert renderings.decide(only, "fastest", _facts(False)).rendering == "bf16"
    no_dot = renderings.decide(both, "fastest", _facts(False))
    assert no_dot.rendering == "f16" and "no BF16 dot products" in no_dot.why and no_dot.source == "machine"
    prior = renderings.decide(both, "fastest", _facts(True))
    assert prior.rendering == "bf16" and "avx512_bf16" in prior.why and "not yet calibrated" in prior.why
    with pytest.raises(Exception, match="no bf16 rendering"):
        renderings.decide(_manifest_family(tmp_path, ["f16"]), "bf16", _facts(True))
    assert renderings.bf16_dot(_facts(True)) == "avx512_bf16" and renderings.bf16_dot(_facts(False)) is None


def test_a_stored_comparison_picks_the_faster(tmp_path, monkeypatch):
    both = _manifest_family(tmp_path, ["f16", "bf16"])
    slow_bf16 = {"f16": {"prefill_token_s": 0.010, "call_s": {1: 0.08, 16: 0.20}},
                 "bf16": {"prefill_token_s": 0.011, "call_s": {1: 0.08, 16: 0.30}}}
    monkeypatch.setattr(renderings, "stored_comparison", lambda *a: slow_bf16)
    c = renderings.decide(both, "fastest", _facts(True))
    assert c.rendering == "f16" and "as calibrated" in c.why and "16-token call 200 against 300 ms" in c.why


def test_a_bound_family_names_its_rendering_as_the_parent(family):
    assert family.roles()[0] == PARENT_ROLE and {"f16", "bf16"} <= set(family.stored_roles())
    assert family.path(PARENT_ROLE) == family.path("f16")  # unbound: the reference rendering
    bound = family.bind("bf16", "test")
    assert bound.path(PARENT_ROLE) == family.path("bf16") and bound.variant(PARENT_ROLE)["type"] == "bf16"
    assert bound.roles() == family.roles() and bound.parent_why == "test"


def test_doctor_says_which_rendering_is_the_parent_and_why(family_dir, monkeypatch):
    monkeypatch.delenv("SPECQUANT_PARENT")
    r = cli(["doctor", "--family", family_dir, "--json"])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    parent = rep["parent"]
    assert parent["rendering"] in ("f16", "bf16") and parent["source"] == "machine" and parent["why"]
    assert rep["settings"]["runtime.parent"]["value"] == parent["rendering"]
    assert rep["settings"]["runtime.parent"]["source"] == "machine"
    r = cli(["doctor", "--family", family_dir, "--json"], env={"SPECQUANT_PARENT": "bf16"})
    assert json.loads(r.stdout)["parent"] == {"rendering": "bf16", "why": "bf16, as asked (--parent)",
                                              "source": "flag", "comparison": None}


def test_a_bad_parent_setting_is_one_line(family_dir):
    r = cli(["doctor", "--family", family_dir, "--parent", "q4"])
    assert_clean_error(r, 2, "--parent", "fastest, f16, bf16")


# -- real contexts ----------------------------------------------------------------------------------------
def test_both_renderings_compute_the_same_model(family):
    """The same weights, two formats: the logits agree closely and the greedy token is the same (BF16's kernels
    round the activations to BF16 before multiplying; F16's to F16)."""
    from specquant_cli.backend.llama import Context, Model

    out = {}
    for r in ("f16", "bf16"):
        m = Model(family.path(r))
        try:
            ctx = Context(m, 256)
            prompt = m.chat_prompt([{"role": "user", "content": "Name three primary colours."}])
            ctx.decode(prompt, logits="last")
            out[r] = np.array(ctx.logits(-1), dtype=np.float32)
        finally:
            m.close()
    a, b = out["f16"], out["bf16"]
    assert int(np.argmax(a)) == int(np.argmax(b))
    assert float(np.corrcoef(a, b)[0, 1]) > 0.999
    assert float(np.max(np.abs(a - b))) < 0.05 * float(np.max(np.abs(a)))


def test_calibration_compares_both_renderings_only_where_bf16_is_multiplied(family):
    from specquant_cli.runtime import Runtime
    from specquant_cli.system import calibration as cal

    for bf16, want in ((True, {"f16", "bf16"}), (False, set())):
        rt = Runtime.open(family.bind("bf16"), n_ctx=512, facts=_facts(bf16))
        try:
            got = rt.costs._compare_renderings(lambda what: None)
            assert set(got) == want
            for t in got.values():
                assert t["prefill_token_s"] > 0 and set(t["call_s"]) == set(cal.RENDERING_SIZES)
            assert "f16" not in rt.pool.loaded()  # the other rendering was loaded only to be timed
        finally:
            rt.close()
