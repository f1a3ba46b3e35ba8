import json

import numpy as np
import pytest

from conftest import run_cli


@pytest.fixture(scope="module")
def quantized(family, tmp_path_factory):
    out = tmp_path_factory.mktemp("fam")
    base = family.path("f16")
    r = run_cli(["quantize", str(base), "--out", str(out), "--json"])
    assert r.exit_code == 0, r.stderr
    return out, json.loads(r.stdout)


def test_variants_exist_and_sizes_are_ordered(quantized):
    out, manifest = quantized
    sizes = {v["type"]: (out / v["path"]).stat().st_size for v in manifest["variants"].values()}
    assert set(sizes) == {"q4_k_m", "q8_0", "f16"}
    assert sizes["q4_k_m"] < sizes["q8_0"] < sizes["f16"]
    assert not [p for p in out.iterdir() if p.name.endswith(".part")]


def test_manifest_fields(quantized, family):
    out, manifest = quantized
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    assert manifest["architecture"] == "llama"
    assert manifest["roles"] == {"q4": "q4_k_m", "q8": "q8_0", "f16": "f16"}
    assert "dequantized" in manifest["base"]["provenance"]
    import llama_cpp

    from specquant_cli.fsutil import sha256_file
    for role, v in manifest["variants"].items():
        p = out / v["path"]
        assert v["size_bytes"] == p.stat().st_size
        assert v["sha256"] == sha256_file(p)
        assert v["llama_cpp_python"] == llama_cpp.__version__
        assert v["role"] == role and v["created"]
    bpw = {v["type"]: v["bits_per_weight"] for v in manifest["variants"].values()}
    assert 4 < bpw["q4_k_m"] < bpw["q8_0"] < bpw["f16"] < 17
    assert (out / "quantize.log").read_text().strip()


def test_each_variant_loads_and_gives_finite_logits(quantized):
    from specquant_cli.backend.llama import Context, Model

    out, manifest = quantized
    for v in manifest["variants"].values():
        m = Model(out / v["path"])
        ctx = Context(m, n_ctx=256)
        ctx.decode(m.tokenize("The capital of France is", add_bos=True), logits="last")
        row = ctx.logits(-1)
        assert row.shape == (m.n_vocab,) and np.isfinite(row).all()
        ctx.close()
        m.close()


def test_quantize_is_idempotent_without_force(quantized, family):
    out, manifest = quantized
    before = {v["path"]: (out / v["path"]).stat().st_mtime_ns for v in manifest["variants"].values()}
    r = run_cli(["quantize", str(family.path("f16")), "--out", str(out), "--types", "q4_k_m,q8_0,f16"])
    assert r.exit_code == 0, r.stderr
    after = {p: (out / p).stat().st_mtime_ns for p in before}
    assert before == after


def _assert_one_line_error(r, out_dir, needle):
    assert r.exit_code == 1, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not out_dir.exists() or not any(p.suffix == ".gguf" or ".part" in p.name for p in out_dir.iterdir())


def test_bad_inputs(tmp_path, family):
    real = family.path("f16")
    text = tmp_path / "notes.gguf"
    text.write_text("just some text, not a model\n")
    head = tmp_path / "head.gguf"
    with open(real, "rb") as f:
        head.write_bytes(f.read(1 << 20))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    cases = [
        ([str(text)], "not a GGUF file"),
        ([str(head)], "truncated or corrupt GGUF"),
        ([str(garbage)], "truncated or corrupt GGUF"),
        ([str(tmp_path / "missing.gguf")], "no such file"),
        ([str(real), "--types", "q4_k_m,q3_weird"], "unknown type 'q3_weird'; valid types: q4_0"),
        ([str(family.path("q8")), "--types", "q4_0"], "quantizing drafts from the quantized parent"),
    ]
    for i, (args, needle) in enumerate(cases):
        out = tmp_path / f"out{i}"
        r = run_cli(["quantize", *args, "--out", str(out)])
        _assert_one_line_error(r, out, needle)


def test_requantize_allowed_with_flag(tmp_path, family):
    out = tmp_path / "rq"
    r = run_cli(["quantize", str(family.path("q8")), "--out", str(out), "--types", "q4_0", "--allow-requantize"])
    assert r.exit_code == 0, r.stderr
    assert (out / "rq-q4_0.gguf").stat().st_size > 0


def test_disk_check_refuses_before_writing(tmp_path, family, monkeypatch):
    import collections

    from specquant_cli.family import quantize as q

    fake = collections.namedtuple("usage", "total used free")(10 << 30, 10 << 30, 1 << 20)
    monkeypatch.setattr(q.shutil, "disk_usage", lambda p: fake)
    out = tmp_path / "nodisk"
    r = run_cli(["quantize", str(family.path("f16")), "--out", str(out), "--types", "q8_0"])
    _assert_one_line_error(r, out, "not enough disk")


def test_debug_env_reraises(tmp_path):
    from typer.testing import CliRunner

    from specquant_cli.cli import app
    from specquant_cli.errors import ModelFileError

    r = CliRunner().invoke(app, ["quantize", str(tmp_path / "nope.gguf")], env={"SPECQUANT_DEBUG": "1"})
    assert isinstance(r.exception, ModelFileError)


def test_family_base_is_f16_with_f32_norms_and_metadata(family):
    import gguf

    reader = gguf.GGUFReader(family.path("f16"))
    kinds = {(len(t.shape) == 1, t.tensor_type.name) for t in reader.tensors}
    assert kinds == {(True, "F32"), (False, "F16")}
    assert reader.fields["tokenizer.chat_template"].contents().startswith("{%")
    assert "Q4_1" in reader.fields["specquant.provenance"].contents()
    assert reader.fields["general.file_type"].contents() == 1
