"""Models where they already live (family.refs): `hf:`, `ollama:` and `lmstudio:` references taken by pull, quantize
and --draft-model, read through the real huggingface_hub (offline, over a cache the test lays out as the library does)
and from an ollama store and an LM Studio folder laid out as those tools lay them out; `list --found`; the draft
candidates named for an adopted parent; bad references, each one line naming the reference and the problem. The
stores are only ever read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hostile_util import assert_clean_error, tiny_llama
from stores_util import hf_repo, lmstudio_model, ollama_model, split_gguf

from conftest import run_cli


def stat_snapshot(root: Path) -> dict:
    """Every entry under root with what would change if anything wrote, moved or deleted it (links as links)."""
    out = {}
    for dirpath, dirnames, files in os.walk(root):
        for name in dirnames + files:
            p = Path(dirpath) / name
            st = os.lstat(p)
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino,
                                             os.readlink(p) if p.is_symlink() else None)
    return out


@pytest.fixture
def stores(tmp_path, monkeypatch) -> dict[str, Path]:
    """Empty stores named by their variables (offline Hugging Face cache), and a current folder that is no
    checkout (families go to the test's models folder)."""
    roots = {k: tmp_path / k for k in ("hf", "ollama", "lms", "work")}
    for p in roots.values():
        p.mkdir()
    (roots["ollama"] / "manifests").mkdir()
    (roots["ollama"] / "blobs").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(roots["hf"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OLLAMA_MODELS", str(roots["ollama"]))
    monkeypatch.setenv("LMSTUDIO_MODELS", str(roots["lms"]))
    monkeypatch.chdir(roots["work"])
    return roots


def listed(*args) -> list[dict]:
    r = run_cli(["list", "--json", *args])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


# -- the real 135M family's files in each store ------------------------------------------------------------------

@pytest.fixture
def filled(stores, family_dir, monkeypatch) -> dict[str, Path]:
    monkeypatch.setenv("SPECQUANT_PARENT", "fastest")  # a family of a quantized file has it as its only parent
    q8, q4 = family_dir / "smollm2-135m-q8_0.gguf", family_dir / "smollm2-135m-q4_k_m.gguf"
    ollama_model(stores["ollama"], "smollm2", "135m-q8", q8)
    ollama_model(stores["ollama"], "smollm2", "135m-q4", q4)
    hf_repo(stores["hf"], "tester/SmolLM2-135M-GGUF", {"SmolLM2-135M-Q8_0.gguf": q8, "README.md": q8.parent /
                                                       "manifest.json"})
    lmstudio_model(stores["lms"], "lmtester", "SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct-Q8_0.gguf", q8)
    return stores


def chat_answers(family: str) -> str:
    r = run_cli(["chat", "--family", family, "--policy", "parent", "--max-tokens", "8", "Say hello."])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip(), r.stderr
    return r.stdout


def test_pull_from_each_store_gives_a_family_chat_answers_with(filled):
    before = {k: stat_snapshot(filled[k]) for k in ("hf", "ollama", "lms")}
    for ref, name, source in (
            ("hf:tester/SmolLM2-135M-GGUF:Q8_0", "SmolLM2-135M-Q8_0",
             "hf:tester/SmolLM2-135M-GGUF/SmolLM2-135M-Q8_0.gguf"),
            ("ollama:smollm2:135m-q8", "smollm2-135m-q8", "ollama:smollm2:135m-q8"),
            ("lmstudio:lmtester/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct-Q8_0",
             "lmstudio:lmtester/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q8_0.gguf")):
        r = run_cli(["pull", ref])
        assert r.exit_code == 0, r.stderr
        assert f"from: {source}" in r.stderr and "Traceback" not in r.stderr
        chat_answers(name)
    rows = {x["name"]: x for x in listed()}
    assert rows["SmolLM2-135M-Q8_0"]["source"].startswith("hf:tester/SmolLM2-135M-GGUF/")
    assert rows["smollm2-135m-q8"]["source"] == "ollama:smollm2:135m-q8"
    assert rows["SmolLM2-135M-Instruct-Q8_0"]["source"].startswith("lmstudio:lmtester/")
    table = run_cli(["list"]).stdout
    assert "ollama:smollm2:135m-q8" in table and "FROM" in table
    # adopted without a copy: the family's parent is the store's own file (a hard link), and the stores are unchanged
    from specquant_cli.family.manifest import Family

    fam = Family.load(Path(rows["smollm2-135m-q8"]["folder"]))
    assert any(os.path.samefile(fam.path("own"), b) for b in (filled["ollama"] / "blobs").iterdir())
    assert {k: stat_snapshot(filled[k]) for k in ("hf", "ollama", "lms")} == before


def test_draft_model_from_ollama_adds_a_sibling_and_list_found_lists_every_store(filled):
    r = run_cli(["pull", "ollama:smollm2:135m-q8"])
    assert r.exit_code == 0, r.stderr
    assert "draft candidate: ollama:smollm2:135m-q4" in r.stderr  # a smaller model of its vocabulary, found
    doctor = run_cli(["doctor", "--family", "smollm2-135m-q8", "--json"])
    assert [c["reference"] for c in json.loads(doctor.stdout)["family"]["draft_candidates"]] == \
        ["ollama:smollm2:135m-q4"]
    r = run_cli(["quantize", "--family", "smollm2-135m-q8", "--draft-model", "ollama:smollm2:135m-q4"])
    assert r.exit_code == 0, r.stderr
    from specquant_cli.family.manifest import Family

    fam = Family.load(Path(listed()[0]["folder"]))
    assert fam.siblings() == ["sibling"]
    assert fam.variant("sibling")["sibling"]["source"] == "ollama:smollm2:135m-q4"
    r = run_cli(["chat", "--family", "smollm2-135m-q8", "--policy", "spec-sibling", "--max-tokens", "8", "Hi"])
    assert r.exit_code == 0 and r.stdout.strip(), r.stderr
    found = run_cli(["list", "--found", "--json"])
    refs = {x["reference"]: x for x in json.loads(found.stdout)}
    assert set(refs) == {"hf:tester/SmolLM2-135M-GGUF/SmolLM2-135M-Q8_0.gguf", "ollama:smollm2:135m-q4",
                         "ollama:smollm2:135m-q8",
                         "lmstudio:lmtester/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q8_0.gguf"}
    assert refs["ollama:smollm2:135m-q4"]["type"] == "Q4_K_M" and refs["ollama:smollm2:135m-q8"]["type"] == "Q8_0"
    table = run_cli(["list", "--found"]).stdout.splitlines()
    assert table[0].split() == ["REFERENCE", "TYPE", "SIZE", "PATH"] and len(table) == 5


# -- fast: tiny models and hand-made stores ------------------------------------------------------------------------

def test_a_split_model_is_fetched_whole_and_merged(stores, tmp_path):
    from specquant_cli.family.gguf_read import read_info

    src = tiny_llama(tmp_path / "tiny-f16.gguf", layers=2)
    parts = split_gguf(src, tmp_path, "tiny-F16", count=3)
    hf_repo(stores["hf"], "tester/tiny-GGUF", {p.name: p for p in parts})
    r = run_cli(["pull", "hf:tester/tiny-GGUF:F16", "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    rows = listed()
    assert [x["source"] for x in rows] == ["hf:tester/tiny-GGUF/tiny-F16-00001-of-00003.gguf"]
    base = Path(rows[0]["folder"]) / "tiny-F16.gguf"
    assert read_info(base).n_params == read_info(src).n_params
    found = json.loads(run_cli(["list", "--found", "--json"]).stdout)
    assert [(x["reference"], x["size_bytes"]) for x in found] == [
        ("hf:tester/tiny-GGUF/tiny-F16-00001-of-00003.gguf", sum(p.stat().st_size for p in parts))]


def test_merge_keeps_every_tensor_byte_for_byte(tmp_path):
    import gguf
    import numpy as np

    from specquant_cli.family.gguf_split import merge

    src = tiny_llama(tmp_path / "t.gguf", layers=2)
    parts = split_gguf(src, tmp_path, "t", count=2)
    merge(parts, tmp_path / "merged.gguf")
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(tmp_path / "merged.gguf"))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert all(np.array_equal(np.asarray(x.data), np.asarray(y.data)) for x, y in zip(a.tensors, b.tensors))
    assert "split.count" not in b.fields and b.fields["general.architecture"].contents() == "llama"


@pytest.mark.parametrize("ref, needles", [
    ("hf:justone", ["hf:justone", "malformed"]),
    ("hf:a/b:Q4 K", ["malformed"]),
    ("hf:a/b/../x.gguf", ["malformed"]),
    ("ollama:", ["ollama:", "malformed"]),
    ("ollama:a/b/c/d", ["malformed"]),
    ("lmstudio:onlyone", ["lmstudio:onlyone", "malformed"]),
    ("lmstudio:a/b/c.bin", ["malformed"]),
])
def test_a_malformed_reference_is_one_line(stores, ref, needles):
    assert_clean_error(run_cli(["pull", ref]), 1, *needles)
    assert_clean_error(run_cli(["quantize", ref, "--family", "x"]), 1, *needles)


def test_ollama_problems_are_one_line_naming_the_reference(stores, tmp_path):
    root = stores["ollama"]
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 60)
    ollama_model(root, "m", "v1", fake)
    assert_clean_error(run_cli(["pull", "ollama:m:v2"]), 1, "ollama:m:v2", "no tag v2", "v1")
    assert_clean_error(run_cli(["pull", "ollama:m"]), 1, "ollama:m", "no tag latest")
    assert_clean_error(run_cli(["pull", "ollama:other"]), 1, "ollama:other", "no model other")
    ollama_model(root, "m", "nomodel", fake, layers=[{"mediaType": "application/vnd.ollama.image.template",
                                                      "digest": "sha256:" + "0" * 64, "size": 1}])
    assert_clean_error(run_cli(["pull", "ollama:m:nomodel"]), 1, "ollama:m:nomodel", "no model layer")
    ollama_model(root, "m", "bad", fake, digest="1" * 64)
    (root / "blobs" / f"sha256-{'1' * 64}").write_bytes(fake.read_bytes() + b"x")  # not what the digest names
    assert_clean_error(run_cli(["pull", "ollama:m:bad"]), 1, "ollama:m:bad", "digest mismatch")
    assert_clean_error(run_cli(["quantize", "--family", "x", "--draft-model", "ollama:m:bad"]), 1, "digest mismatch")
    (root / "manifests" / "registry.ollama.ai" / "library" / "m" / "junk").write_text("{not json")
    assert_clean_error(run_cli(["pull", "ollama:m:junk"]), 1, "ollama:m:junk", "cannot be read")


def test_hugging_face_problems_are_one_line_naming_the_reference(stores, tmp_path):
    tiny = tiny_llama(tmp_path / "tiny-Q8_0.gguf")
    hf_repo(stores["hf"], "tester/tiny-GGUF", {"tiny-Q8_0.gguf": tiny})
    assert_clean_error(run_cli(["pull", "hf:tester/tiny-GGUF:Q5_K_M"]), 1, "hf:tester/tiny-GGUF:Q5_K_M",
                       "no Q5_K_M", "tiny-Q8_0.gguf")
    assert_clean_error(run_cli(["pull", "hf:tester/absent:Q8_0"]), 1, "hf:tester/absent:Q8_0", "not in the Hugging "
                       "Face cache", "HF_HUB_OFFLINE")
    assert_clean_error(run_cli(["pull", "hf:tester/absent/x.gguf"]), 1, "hf:tester/absent/x.gguf", "HF_HUB_OFFLINE")
    parts = split_gguf(tiny_llama(tmp_path / "s.gguf", layers=2), tmp_path, "s", count=3)
    hf_repo(stores["hf"], "tester/split-GGUF", {p.name: p for p in parts if "00002" not in p.name})
    assert_clean_error(run_cli(["pull", "hf:tester/split-GGUF/s-00001-of-00003.gguf"]), 1,
                       "hf:tester/split-GGUF", "s-00002-of-00003.gguf", "missing")


def test_lmstudio_problems_are_one_line(stores, tmp_path):
    a = tiny_llama(tmp_path / "a.gguf")
    lmstudio_model(stores["lms"], "pub", "repo", "a-Q8_0.gguf", a)
    lmstudio_model(stores["lms"], "pub", "repo", "a-Q4_0.gguf", a)
    assert_clean_error(run_cli(["pull", "lmstudio:pub/repo"]), 1, "lmstudio:pub/repo", "2 model files", "name one")
    assert_clean_error(run_cli(["pull", "lmstudio:pub/repo/b.gguf"]), 1, "no b.gguf")
    assert_clean_error(run_cli(["pull", "lmstudio:pub/none"]), 1, "no pub/none")
    lmstudio_model(stores["lms"], "pub", "split", "s-00001-of-00002.gguf", a)
    assert_clean_error(run_cli(["pull", "lmstudio:pub/split"]), 1, "s-00002-of-00002.gguf", "missing")


def test_no_store_at_all_is_one_line(stores, tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "none"))
    monkeypatch.setenv("LMSTUDIO_MODELS", str(tmp_path / "none"))
    assert_clean_error(run_cli(["pull", "ollama:m"]), 1, "no ollama store", "OLLAMA_MODELS")
    assert_clean_error(run_cli(["pull", "lmstudio:a/b"]), 1, "no LM Studio models folder", "LMSTUDIO_MODELS")
    r = run_cli(["list", "--found"])
    assert r.exit_code == 0 and r.stdout == "" and "no GGUF found" in r.stderr


def test_the_stores_follow_their_tools_variables(monkeypatch, tmp_path):
    from specquant_cli.settings import model_stores

    for k in ("HF_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "OLLAMA_MODELS", "LMSTUDIO_MODELS", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    s = model_stores()
    assert (s.hf_cache, s.hf_offline, s.ollama) == (tmp_path / ".cache/huggingface/hub", False,
                                                    tmp_path / ".ollama/models")
    assert s.lmstudio == (tmp_path / ".lmstudio/models", tmp_path / ".cache/lm-studio/models")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "h"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LMSTUDIO_MODELS", str(tmp_path / "l"))
    s = model_stores()
    assert (s.hf_cache, s.hf_offline, s.lmstudio) == (tmp_path / "h/hub", True, (tmp_path / "l",))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert model_stores().hf_cache == tmp_path / "c"
