"""The prompt sets the published figures use ship inside the package, selectable by name (`--dataset spec-bench`,
`--dataset gsm8k`), with their licence notes beside them."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from specquant_cli.bench import datasets


def test_spec_bench_and_gsm8k_ship_in_the_package_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no file of those names here: the names select the shipped sets
    spec = datasets.load([Path("spec-bench")])
    assert len(spec) == 480
    assert {i.category for i in spec} >= {"writing", "coding", "translation", "summarization", "qa", "rag",
                                          "math_reasoning"}
    six = datasets.load([Path("spec-bench")], ["writing", "roleplay", "reasoning", "coding", "math", "extraction"], 3)
    assert len(six) == 18  # the README's first figure: 6 categories x 3 prompts
    gsm = datasets.load([Path("gsm8k")])
    assert len(gsm) == 80 and all(i.reference for i in gsm)
    notice = resources.files("specquant_cli.bench").joinpath("NOTICE-datasets.txt").read_text(encoding="utf-8")
    assert "Apache License 2.0" in notice and "MIT License" in notice


def test_a_file_of_that_name_is_read_as_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("gsm8k").write_text('{"question_id": 1, "category": "mine", "turns": ["hi"]}\n')
    assert [i.category for i in datasets.load([Path("gsm8k")])] == ["mine"]
