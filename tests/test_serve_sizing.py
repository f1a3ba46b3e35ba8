"""serve decides how many sequences to decode together before any context is sized, and sizes every context for
exactly those: without --parallel and without a calibration (the prior cost curve), with a calibration whose
curve says 1, and with one that says 8. Whatever it decides, a request sees --ctx positions: a 5000-token
max_tokens on a 4096 context is a 400, before a stream starts."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
from test_serve import ServerProc

from specquant_cli.decoding.gamma import verify_shape
from specquant_cli.serving.slots import best_parallel

CTX = 4096
LINEAR = {n: 0.05 * n for n in range(1, 17)}  # a call on n tokens costs n single calls: batching never pays
FLAT = {n: 0.05 for n in range(1, 17)}  # a call costs the same at any size: every doubling pays


def _family_copy(src, dst):
    """The demo family in `dst` (its model files hard-linked, nothing measured): a calibration of its own."""
    dst.mkdir()
    for p in src.iterdir():
        if p.suffix == ".gguf":
            os.link(p, dst / p.name)
        elif p.name == "manifest.json":
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _calibrate(root, curve: dict[int, float]) -> None:
    """Store a calibration for this machine, as serve's fingerprint (--threads 1, no RPC) finds it."""
    from specquant_cli.system import calibration_file as cal
    from specquant_cli.system.calibration import Calibration
    from specquant_cli.system.hardware import detect

    cal.save(root, cal.fingerprint(detect(), 1, []), Calibration(parent_call_s=dict(curve)))


CASES = {"uncalibrated": (None, best_parallel(verify_shape), "the prior cost curve"),
         "calibration-says-1": (LINEAR, 1, "this machine's calibration"),
         "calibration-says-8": (FLAT, 8, "this machine's calibration")}


@pytest.mark.parametrize("case", list(CASES))
def test_serve_sizes_its_contexts_for_the_sequences_it_runs(family_dir, tmp_path, case):
    curve, want, why = CASES[case]
    root = _family_copy(family_dir, tmp_path / "fam")
    if curve is not None:
        _calibrate(root, curve)
    s = ServerProc(["--family", str(root), "--policy", "parent", "--policies", "parent", "--ctx", str(CTX)])
    try:
        h = httpx.get(s.url + "/health", timeout=10).json()
        assert h["parallel"] == want
        assert f"{want} at once ({why}" in s.log()
        # the KV memory reserved is what runs: --ctx positions for each of the N sequences, in the one model loaded
        assert h["kv"] == {"parent": {"positions": CTX * want, "sequences": want}}
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for stream in (True, False):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5000, stream=stream)
            assert "context" in e.value.message
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.choices[0].message.content
    finally:
        assert s.stop() == 0


def test_parallel_given_is_never_overridden(family_dir, tmp_path):
    root = _family_copy(family_dir, tmp_path / "fam")
    _calibrate(root, FLAT)  # would say 8
    s = ServerProc(["--family", str(root), "--policy", "parent", "--policies", "parent", "--parallel", "2"],
                   env={"SPECQUANT_CTX": "1024"})
    try:
        h = httpx.get(s.url + "/health", timeout=10).json()
        assert h["parallel"] == 2 and h["kv"] == {"parent": {"positions": 2048, "sequences": 2}}
        assert "2 at once (--parallel)" in s.log()
    finally:
        assert s.stop() == 0
