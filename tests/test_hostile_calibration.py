"""Hostile calibration state: stored entries that lie, read-only families, interrupted activation runs,
unparsable importance matrices, bad role names and a quantize.log that grew without bound.

The demo family is hard-linked into each test's folder (its GGUFs are only ever read or replaced by
rename, never written in place) with its own copy of the manifest. The real measurement is the demo family's
own (the real `calibrate`, once per machine). The garbage-file, bad-entry and read-only cases run the real CLI
with `system.measure.measure` and `compare_renderings` (the timing loops) replaced by ones returning that real
measurement: the load, the check, the reason line, the models' loading and the save (to the XDG cache for a
read-only family) are all real.

Read-only folders are read-only bind mounts (`mount --bind` + `remount,ro`): the tests run as root, who
ignores permission bits, while a read-only mount refuses everyone (EROFS). Skipped where mounting is not
allowed."""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hostile_util import assert_clean_error, cli, link_family, snapshot, temps, tiny_llama

from specquant_cli.system import calibration_file as cal
from specquant_cli.system import measure as measuring
from specquant_cli.system.calibration import MAX_BATCH, Calibration

SPECQUANT = [sys.executable, "-m", "specquant_cli"]
HANG_S = 120


# -- helpers ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def read_only(folder: Path):
    """`folder` as a read-only bind mount for the block (EROFS for root too)."""
    folder = str(folder)
    r = subprocess.run(["mount", "--bind", folder, folder], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot bind-mount here ({r.stderr.decode().strip()})")
    try:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", folder], capture_output=True)
        if r.returncode:
            pytest.skip(f"cannot remount read-only here ({r.stderr.decode().strip()})")
        with pytest.raises(OSError):
            Path(folder, "probe").write_text("x")
        yield
    finally:
        subprocess.run(["umount", folder], capture_output=True)


def reason_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("calibration:")]


def no_traceback(r) -> None:
    text = r.stdout + r.stderr
    assert "Traceback" not in text and "internal error" not in text and "Exception ignored" not in text, text


@pytest.fixture(autouse=True)
def xdg(tmp_path, monkeypatch, selftest_cache) -> Path:
    """A per-test XDG cache holding only the session's llama.cpp self-test result (so none reruns)."""
    xdg = tmp_path / "xdg"
    (xdg / "specquant").mkdir(parents=True)
    st = selftest_cache / "specquant" / "selftest.json"
    if st.exists():
        shutil.copyfile(st, xdg / "specquant" / "selftest.json")
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    return xdg


def without(snap: dict, *names: str) -> dict:
    """A snapshot without the run's own log and lock (an interrupted run still logged the model's load)."""
    return {k: v for k, v in snap.items() if not k.startswith(names)}


LOGS = ("quantize.log", ".specquant.lock")


def stub_timings(mp, entry: dict) -> list:
    """measure() returns `entry` (a real measurement) instantly, and compare_renderings() its renderings; the list
    counts measure()'s calls."""
    calls = []

    def measure(ctx_for, parent, drafts, progress=None, siblings=()):
        calls.append((parent, tuple(drafts)))
        return Calibration.from_dict(json.loads(json.dumps(entry)))

    mp.setattr(measuring, "measure", measure)
    mp.setattr(measuring, "compare_renderings", lambda ctx_for, renderings, tick=None: json.loads(
        json.dumps(entry.get("renderings") or {})))
    return calls


@pytest.fixture(scope="module")
def measured(family_dir, tmp_path_factory):
    """One real measurement (the demo family's, by the real `calibrate`), then calibrate over a garbage
    calibration.json measuring it again (stub_timings): (family, this machine's key, its entry)."""
    r = cli(["calibrate", "--family", family_dir, "--json"])
    assert r.exit_code == 0, r.stderr
    real = json.loads(r.stdout)
    fam = link_family(family_dir, tmp_path_factory.mktemp("measured") / "fam")
    (fam / cal.CALIBRATION_FILE).write_text('{"half an object": ')
    with pytest.MonkeyPatch.context() as mp:
        calls = stub_timings(mp, real)
        r = cli(["calibrate", "--family", fam, "--json"])
    assert r.exit_code == 0 and len(calls) == 1, r.stderr
    no_traceback(r)
    lines = reason_lines(r.stderr)
    assert len(lines) == 1 and "is not valid JSON" in lines[0] and lines[0].endswith("measuring again"), r.stderr
    data = json.loads((fam / cal.CALIBRATION_FILE).read_text())
    (key, entry), = data.items()
    assert cal.entry_problem(entry) is None
    assert json.loads(r.stdout)["parent_call_s"] == entry["parent_call_s"]
    return fam, key, entry


@pytest.fixture
def fam(family_dir, tmp_path):
    return link_family(family_dir, tmp_path / "fam")


@pytest.fixture
def stub_measure(measured, monkeypatch):
    """The timing loops stubbed with the module's real measurement (stub_timings)."""
    return stub_timings(monkeypatch, measured[2])


def _valid_after(root: Path, key: str) -> Calibration:
    got, why = cal.load_checked(root, json.loads(key))
    assert why is None and got is not None, why
    return got


# -- 1. stored entries that lie: each dropped with its reason on stderr, measured again, valid after ---------
def _set(path: tuple, value):
    def mutate(data, key):
        d = data[key]
        for p in path[:-1]:
            d = d[p]
        d[path[-1]] = value
    return mutate


def _drop(name: str):
    def mutate(data, key):
        del data[key][name]
    return mutate


def _whole_entry(value):
    def mutate(data, key):
        data[key] = value
    return mutate


def _older_schema(data, key):
    fp = json.loads(key)
    fp["schema"] = cal.SCHEMA - 1
    data[cal.key_of(fp)] = data.pop(key)


def _runs(values):
    def mutate(data, key):
        data[key]["tokens_per_cycle"]["q4"] = values
    return mutate


def _rename_call_size(data, key):
    calls = data[key]["parent_call_s"]
    calls["abc"] = calls.pop("16")


def _drop_call_size_1(data, key):
    del data[key]["parent_call_s"]["1"]


def _bad_role(data, key):
    data[key]["draft_step_s"]["Q 4!"] = 0.01


BAD_ENTRIES = {  # name -> (mutation of the stored file's data, a phrase of the reason)
    "nan-timing": (_set(("parent_call_s", "1"), math.nan), "parent_call_s[1] is nan, not a finite number"),
    "inf-timing": (_set(("draft_step_s", "q4"), math.inf), "q4 draft_step_s is inf, not a finite number"),
    "negative-timing": (_set(("parent_call_s", "4"), -0.05), "parent_call_s[4] -0.05 s is not a timing"),
    "zero-timing": (_set(("prefill_token_s", "f16"), 0), "f16 prefill_token_s 0 s is not a timing"),
    "absurd-timing": (_set(("draft_pair_s", "q8"), 1e9), "q8 draft_pair_s 1e+09 s is not a timing"),
    "boolean-timing": (_set(("parent_call_s", "2"), True), "parent_call_s[2] is a boolean, not a number"),
    "huge-integer": (_set(("parent_call_s", "2"), 10 ** 400), "out of range"),
    "agreement-7.5": (_set(("agreement", "q4"), 7.5), "q4 agreement 7.5 outside [0, 1]"),
    "agreement-minus-3": (_set(("agreement", "q8"), -3), "q8 agreement -3 outside [0, 1]"),
    "agreement-string": (_set(("agreement", "q4"), "x"), "q4 agreement is a string, not a number"),
    "agreement-nan": (_set(("agreement", "q4"), math.nan), "q4 agreement is nan"),
    "acceptance-above-1": (_runs([1.5, 4.0]), "an acceptance of 2.5, outside [0, 1]"),
    "acceptance-negative": (_runs([1.9, 1.2]), "outside [0, 1]"),
    "runs-not-a-list": (_runs({"1": 1.5}), "q4 tokens_per_cycle is not a list"),
    "missing-parent-calls": (_drop("parent_call_s"), "parent_call_s missing"),
    "missing-agreement": (_drop("agreement"), "agreement missing"),
    "calls-a-list": (_set(("parent_call_s",), [0.1, 0.2]), "parent_call_s is a JSON array, not an object"),
    "measured-at-a-number": (_set(("measured_at",), 5), "measured_at is a JSON number, not a string"),
    "entry-a-list": (_whole_entry([1, 2, 3]), "a JSON array, not an object"),
    "entry-null": (_whole_entry(None), "a JSON null, not an object"),
    "call-size-not-a-number": (_rename_call_size, "the call size 'abc'"),
    "call-size-1-missing": (_drop_call_size_1, "are not 1..N"),
    "bad-role-name": (_bad_role, "not a role name"),
    "left-out-numbers": (_set(("left_out",), [1, 2]), "left_out holds something other than role names"),
    "older-schema": (_older_schema, "measured by another version"),
    "draft-call-nan": (_set(("draft_call_s", "q4", "8"), math.nan), "q4 draft_call_s[8] is nan"),
    "draft-call-size-9": (_set(("draft_call_s", "q4", "9"), 0.01), "q4 draft_call_s has the size '9'"),
    "missing-deep-calls": (_drop("deep_call_s"), "deep_call_s missing"),
    "deep-pos-negative": (_set(("deep_pos",), -5), "deep_pos -5 is not a position"),
    "import-zero": (_set(("import_s", "q4", "64"), 0), "q4 import_s[64] 0 s is not a timing"),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_bad_stored_entry_is_measured_again_with_its_reason(measured, fam, stub_measure, case):
    _, key, entry = measured
    mutate, phrase = BAD_ENTRIES[case]
    data = {key: json.loads(json.dumps(entry))}
    mutate(data, key)
    (fam / cal.CALIBRATION_FILE).write_text(json.dumps(data))  # NaN and Infinity as Python writes them
    r = cli(["calibrate", "--family", fam, "--json"])
    assert r.exit_code == 0, r.stderr
    no_traceback(r)
    lines = reason_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert phrase in lines[0] and lines[0].endswith("; measuring again"), lines[0]
    assert "invalid" in lines[0] or "another version" in lines[0]
    assert len(stub_measure) == 1  # measured again, once
    got = _valid_after(fam, key)
    assert got.parent_call_s == {int(k): v for k, v in entry["parent_call_s"].items()}
    assert json.loads(r.stdout)["agreement"] == entry["agreement"]


@pytest.mark.parametrize("lacks", ["long calls", "far calls"])
def test_an_entry_stored_before_the_newer_calls_is_measured_again_by_calibrate(measured, fam, stub_measure, lacks):
    """A valid entry measured before the parent's long calls (LONG_CALLS), or before its calls at the far depth
    (FAR_POS), loads wherever it is read, and `calibrate` measures it again, saying which it lacks; once."""
    _, key, entry = measured
    old = json.loads(json.dumps(entry))
    if lacks == "long calls":
        old["parent_call_s"] = {k: v for k, v in old["parent_call_s"].items() if int(k) <= MAX_BATCH}
        phrase = "stored before parent calls of up to 64 tokens were measured; measuring again"
    else:
        assert old["far_pos"], "the module's measurement has the far calls (a 4096 context)"
        del old["far_call_s"], old["far_pos"]
        phrase = "stored before the parent's calls after 2560 positions were measured; measuring again"
    assert cal.entry_problem(old) is None
    (fam / cal.CALIBRATION_FILE).write_text(json.dumps({key: old}))
    r = cli(["calibrate", "--family", fam, "--json"])
    assert r.exit_code == 0, r.stderr
    no_traceback(r)
    assert [ln for ln in reason_lines(r.stderr) if "measuring again" in ln] == [f"calibration: {phrase}"], r.stderr
    assert len(stub_measure) == 1
    got = _valid_after(fam, key)
    assert got.longest_call == 64 and got.far_pos == 2560
    r = cli(["calibrate", "--family", fam, "--json"])  # now complete: read back, not measured
    assert r.exit_code == 0 and len(stub_measure) == 1, r.stderr


BAD_FILES = {  # name -> (writes the file, a phrase of the reason)
    "garbage-json": (lambda p: p.write_text("{{{ not json"), "is not valid JSON"),
    "a-json-list": (lambda p: p.write_text("[1, 2, 3]"), "holds a JSON array, not an object of entries"),
    "a-json-string": (lambda p: p.write_text('"calibrated"'), "holds a JSON string"),
    "huge-file": (lambda p: p.write_bytes(b" " * (cal.MAX_FILE_BYTES + 1) + b"{}"), "larger than any calibration"),
    "not-utf8": (lambda p: p.write_bytes(b'{"\xff\xfe": 1}'), "is not UTF-8 text"),
    "deeply-nested": (lambda p: p.write_text("[" * 200_000 + "]" * 200_000), "is not valid JSON"),
    "a-folder": (lambda p: p.mkdir(), "is not a regular file"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_unusable_calibration_file_is_measured_again_with_its_reason(measured, fam, stub_measure, case):
    _, key, _ = measured
    write, phrase = BAD_FILES[case]
    write(fam / cal.CALIBRATION_FILE)
    r = cli(["calibrate", "--family", fam, "--json"])
    assert r.exit_code == 0, r.stderr
    no_traceback(r)
    lines = reason_lines(r.stderr)
    assert phrase in lines[0] and lines[0].endswith("; measuring again"), r.stderr
    assert len(stub_measure) == 1
    _valid_after(fam, key)  # in the family file, or (the folder case) in the user cache
    r = cli(["calibrate", "--family", fam, "--json"])  # and read back from there: no second measurement
    assert r.exit_code == 0 and len(stub_measure) == 1, r.stderr
    assert not [ln for ln in reason_lines(r.stderr) if "measuring again" in ln], r.stderr


def test_route_ignores_an_invalid_entry_and_says_so(measured, fam, monkeypatch):
    """The probe's `route --json`: "acceptance prior -300%" and a predicted 1.69x from agreement -3."""
    _, key, entry = measured
    monkeypatch.setattr(measuring, "measure", lambda *a, **k: pytest.fail("route measured"))
    data = {key: json.loads(json.dumps(entry))}
    data[key]["agreement"]["q4"] = -3
    (fam / cal.CALIBRATION_FILE).write_text(json.dumps(data))
    r = cli(["route", "--family", fam, "--json", "--policy", "auto", "Explain why the sky is blue."])
    assert r.exit_code == 0, r.stderr
    no_traceback(r)
    out = json.loads(r.stdout)
    assert out["calibrated"] is False and "-300%" not in r.stdout
    lines = reason_lines(r.stderr)
    assert len(lines) == 1 and "q4 agreement -3 outside [0, 1]" in lines[0] and "not used" in lines[0], r.stderr


def test_route_uses_a_valid_entry_quietly(measured, fam):
    _, key, entry = measured
    (fam / cal.CALIBRATION_FILE).write_text(json.dumps({key: entry}))
    r = cli(["route", "--family", fam, "--json", "--policy", "auto", "Explain why the sky is blue."])
    assert r.exit_code == 0 and json.loads(r.stdout)["calibrated"] is True, r.stderr
    assert reason_lines(r.stderr) == []


def _read_stderr_until(proc, pred, timeout: float) -> list[str]:
    """stderr lines of `proc` until one satisfies `pred` (or it ends, or the time is up)."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    lines, buf, t0 = [], b"", time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not sel.select(timeout=0.5):
            continue
        chunk = os.read(proc.stderr.fileno(), 65536)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            ln, buf = buf.split(b"\n", 1)
            lines.append(ln.decode(errors="replace"))
            if pred(lines[-1]):
                return lines
    return lines


def test_chat_says_why_it_measures_again(measured, fam):
    """The probe's `chat` re-measured silently for a minute over a garbage file: the reason comes first.
    (Stopped at that line: the measurement itself is the module fixture's.)"""
    (fam / cal.CALIBRATION_FILE).write_text("garbage")
    proc = subprocess.Popen([*SPECQUANT, "chat", "--family", str(fam), "--policy", "auto", "--max-tokens", "4", "hi"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        lines = _read_stderr_until(proc, lambda ln: ln.startswith("calibration:"), HANG_S)
    finally:
        proc.kill()
        proc.wait()
    assert lines and lines[-1].startswith("calibration:"), lines
    assert "is not valid JSON" in lines[-1] and lines[-1].endswith("measuring again"), lines[-1]
    assert not any("Traceback" in ln for ln in lines)


# -- 2. a read-only family: the calibration lives in the user cache ------------------------------------------
def test_read_only_family_keeps_its_calibration_in_the_user_cache(family_dir, tmp_path, xdg, stub_measure):
    fam = link_family(family_dir, tmp_path / "fam")
    before = snapshot(fam)
    with read_only(fam):
        r = cli(["calibrate", "--family", fam, "--json"])  # measured (the module's real measurement), then saved
        assert r.exit_code == 0, r.stderr
        no_traceback(r)
        cached = cal.cache_file(fam)
        assert cached.parent == xdg / "specquant" / "calibrations" and cached.is_file()
        lines = reason_lines(r.stderr)
        assert len(lines) == 1 and f"cannot write in the family folder {fam}" in lines[0], r.stderr
        assert "Read-only file system" in lines[0] and lines[0].endswith(f"kept in {cached}"), lines[0]
        data = json.loads(cached.read_text())
        (key, entry), = data.items()
        assert cal.entry_problem(entry) is None and json.loads(r.stdout)["parent_call_s"] == entry["parent_call_s"]
        assert snapshot(fam) == before  # nothing written in the family
        # read back from the cache: no second measurement, by calibrate or by route
        r = cli(["calibrate", "--family", fam, "--json"])
        assert r.exit_code == 0 and json.loads(r.stdout)["parent_call_s"] == entry["parent_call_s"], r.stderr
        assert reason_lines(r.stderr) == []
        r = cli(["route", "--family", fam, "--json", "--policy", "auto", "hello"])
        assert r.exit_code == 0 and json.loads(r.stdout)["calibrated"] is True, r.stderr
        assert len(stub_measure) == 1
    # keyed by the family's real path and its base: another family gets another file
    other = link_family(family_dir, tmp_path / "other")
    assert cal.cache_file(other) != cached


def test_calibrate_with_nowhere_to_save_fails_before_measuring(fam, monkeypatch, xdg):
    monkeypatch.setattr(measuring, "measure", lambda *a, **k: pytest.fail("measured with nowhere to save"))
    before = snapshot(fam)
    with read_only(fam), read_only(xdg):
        t0 = time.monotonic()
        r = cli(["calibrate", "--family", fam])
        line = assert_clean_error(r, 1, "cannot save a calibration", str(fam), "not writable",
                                  str(xdg / "specquant" / "calibrations"), "Read-only file system")
        assert time.monotonic() - t0 < 30, line  # no model was loaded to be measured
    assert snapshot(fam) == before


def test_calibrate_activations_on_a_read_only_family_is_one_line(fam):
    before = snapshot(fam)
    with read_only(fam):
        r = cli(["calibrate-activations", "--family", fam, "--tokens", "64"])
        assert_clean_error(r, 1, f"family folder {fam}", "not writable", "Read-only file system")
    assert snapshot(fam) == before


# -- 3. calibrate-activations stops on Ctrl-C and SIGTERM, committing nothing ----------------------------------
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_calibrate_activations_is_interruptible(fam, sig):
    before = snapshot(fam)
    proc = subprocess.Popen([*SPECQUANT, "calibrate-activations", "--family", str(fam), "--tokens", "4096"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        lines = _read_stderr_until(proc, lambda ln: " tokens (" in ln, HANG_S)
        assert lines and " tokens (" in lines[-1] and proc.poll() is None, lines  # the collection is under way
        t0 = time.monotonic()
        proc.send_signal(getattr(signal, sig))
        rc = proc.wait(timeout=10)
        took = time.monotonic() - t0
        rest = proc.stderr.read().decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 130 and rest.strip().endswith("interrupted"), (rc, rest)
    assert took < 5, took
    assert "Traceback" not in rest and "Exception ignored" not in rest, rest
    assert not (fam / "imatrix.gguf").exists() and temps(fam) == []
    after = snapshot(fam)
    assert without(after, *LOGS) == without(before, *LOGS)  # manifest and variants byte-identical
    assert not [k for k in after if k.startswith(".") and k not in (".specquant.lock",)], after


# -- 4. unclear errors made one clear line --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny base and a family quantized from it (q4_0 and the f16)."""
    root = tmp_path_factory.mktemp("tiny")
    base = tiny_llama(root / "tiny-f16.gguf", seed=3)
    r = cli(["quantize", base, "--out", root / "fam", "--types", "q4_0,f16", "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    return base, root / "fam"


def _imatrix_of(base: Path, path: Path, fill=1.0, counts_rows=None) -> Path:
    """An imatrix GGUF for `base`'s weights (sums `fill` everywhere), as calibrate-activations writes one."""
    import gguf

    from specquant_cli.family.imatrix import ActivationStats

    st = ActivationStats()
    for t in gguf.GGUFReader(str(base)).tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            st.sums[t.name] = np.full((1, int(t.shape[0])), fill, np.float64)
            st.counts[t.name] = np.full(counts_rows or 1, 16.0)
    st.chunks, st.chunk_size = 1, 16
    st.save(path, {"source": "test"})
    return path


BAD_IMATRICES = {  # name -> (writes the file, a phrase of the reason)
    "garbage": (lambda p, base: p.write_bytes(os.urandom(4096)), "not a readable imatrix GGUF"),
    "empty": (lambda p, base: p.write_bytes(b""), "not a readable imatrix GGUF"),
    "text": (lambda p, base: p.write_text("in_sum2 = 1, 2, 3\n"), "not a readable imatrix GGUF"),
    "a-model": (lambda p, base: shutil.copyfile(base, p), "no importance data in it"),
    "truncated": (lambda p, base: p.write_bytes(_imatrix_of(base, p).read_bytes()[:300]),
                  "not a readable imatrix GGUF"),
    "nan-sums": (lambda p, base: _imatrix_of(base, p, fill=math.nan), "non-finite importance data"),
    "counts-mismatch": (lambda p, base: _imatrix_of(base, p, counts_rows=3), "3 counts for 1 matrices"),
}


@pytest.mark.parametrize("case", list(BAD_IMATRICES))
def test_unparsable_imatrix_is_named_up_front(tiny, tmp_path, case):
    base, built = tiny
    fam = Path(shutil.copytree(built, tmp_path / "fam"))
    bad = tmp_path / "bad.imatrix.gguf"
    write, phrase = BAD_IMATRICES[case]
    write(bad, base)
    before = snapshot(fam)
    r = cli(["quantize", base, "--out", fam, "--types", "q4i", "--imatrix", bad, "--threads", "1"])
    line = assert_clean_error(r, 1, f"--imatrix {bad}", phrase)
    assert "quantize.log" not in line
    assert without(snapshot(fam), ".specquant.lock") == before  # no child started: not even the log was written
    assert temps(fam) == []


def test_a_bad_imatrix_fails_before_the_plain_types_are_quantized(tiny, tmp_path):
    base, built = tiny
    fam = Path(shutil.copytree(built, tmp_path / "fam"))
    bad = tmp_path / "bad.imatrix.gguf"
    bad.write_bytes(os.urandom(4096))
    before = snapshot(fam)
    r = cli(["quantize", base, "--out", fam, "--types", "q8_0,q4i", "--imatrix", bad, "--threads", "1", "--force"])
    assert_clean_error(r, 1, f"--imatrix {bad}", "not a readable imatrix GGUF")
    assert without(snapshot(fam), ".specquant.lock") == before
    assert temps(fam) == []


def test_a_valid_imatrix_passes_the_check(tiny, tmp_path):
    base, built = tiny
    fam = Path(shutil.copytree(built, tmp_path / "fam"))
    good = _imatrix_of(base, tmp_path / "good.imatrix.gguf")
    r = cli(["quantize", base, "--out", fam, "--types", "q4i", "--imatrix", good, "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    assert "q4i" in json.loads((fam / "manifest.json").read_text())["variants"]


def test_a_broken_own_imatrix_is_named_up_front(tiny, tmp_path):
    base, built = tiny
    fam = Path(shutil.copytree(built, tmp_path / "fam"))
    (fam / "imatrix.gguf").write_bytes(b"GGUF" + os.urandom(200))
    m = json.loads((fam / "manifest.json").read_text())
    m["imatrix"] = {"file": "imatrix.gguf", "sha256": None, "base_sha256": m["base"]["sha256"]}
    (fam / "manifest.json").write_text(json.dumps(m))
    before = snapshot(fam)
    r = cli(["quantize", base, "--out", fam, "--types", "q4i", "--threads", "1"])
    assert_clean_error(r, 1, str(fam / "imatrix.gguf"), "not a readable imatrix GGUF", "calibrate-activations again")
    assert without(snapshot(fam), ".specquant.lock") == before


def test_calibrate_activations_with_too_little_disk_is_refused_before_the_run(fam, monkeypatch):
    import specquant_cli.family.activations as act

    real = shutil.disk_usage
    monkeypatch.setattr(act.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    monkeypatch.setattr(act, "collect", lambda *a, **k: pytest.fail("collected with no disk to keep the result"))
    before = snapshot(fam)
    r = cli(["calibrate-activations", "--family", fam, "--tokens", "64"])
    assert_clean_error(r, 1, f"not enough disk in {fam}", "MiB free")
    assert without(snapshot(fam), *LOGS) == without(before, *LOGS)


@pytest.mark.parametrize("where", ["save", "commit"])
def test_calibrate_activations_full_disk_at_the_write_is_one_line(fam, monkeypatch, where):
    import errno

    import specquant_cli.family.imatrix as im
    from specquant_cli.family import journal

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "save":
        monkeypatch.setattr(im.ActivationStats, "save", full)
    else:
        monkeypatch.setattr(journal, "commit", full)
    before = snapshot(fam)
    r = cli(["calibrate-activations", "--family", fam, "--tokens", "64", "--chunk", "64"])
    assert_clean_error(r, 1, f"cannot write {fam / 'imatrix.gguf'}", "No space left on device", str(fam))
    assert without(snapshot(fam), *LOGS) == without(before, *LOGS) and temps(fam) == []


BAD_ROLES = {
    "": "--role is empty",
    "Q3": "--role 'Q3'",
    "3q": "--role '3q'",
    "q-3": "--role 'q-3'",
    "q 3": "--role 'q 3'",
    "q4_0": "--role 'q4_0'",
    "f16": "--role 'f16'",
    "q8": "--role 'q8'",
    "x" * 33: "--role 'xxxx",
    "é": "--role 'é'",
}


@pytest.mark.parametrize("role", list(BAD_ROLES), ids=lambda r: repr(r)[:12])
def test_bad_role_names_are_refused_with_the_rule(tiny, tmp_path, role):
    base, _ = tiny
    out = tmp_path / "out"
    r = cli(["quantize", base, "--out", out, "--types", "q4_0", "--grade", "4.5", "--role", role])
    assert_clean_error(r, 1, BAD_ROLES[role], "starts with a lower-case letter", "not a quantization type")
    assert not out.exists()


def test_an_empty_role_without_grade_is_refused(tiny, tmp_path):
    base, _ = tiny
    r = cli(["quantize", base, "--out", tmp_path / "out", "--types", "q4_0", "--role", ""])
    assert_clean_error(r, 1, "--role names the role of a --grade variant")


# -- 5. quantize.log holds the last run only --------------------------------------------------------------
def _quantize_process(base: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SPECQUANT, "quantize", str(base), "--out", str(out), "--types", "q8_0,f16",
                           "--threads", "1", *extra], capture_output=True, timeout=HANG_S)


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_quantize_log_is_bounded_over_runs(tiny, tmp_path):
    """Each run (a process of its own, as from a shell) starts the log afresh: one run's worth, not a sum."""
    base, _ = tiny
    out = tmp_path / "fam"
    sizes = []
    for _ in range(3):
        p = _quantize_process(base, out, "--force")
        assert p.returncode == 0, p.stderr
        assert sorted(n for n in os.listdir(out) if n.startswith("quantize.log")) == ["quantize.log"]
        text = (out / "quantize.log").read_text()
        assert text.strip()
        sizes.append(len(text))
    assert max(sizes) < 1.5 * min(sizes), sizes  # one run's worth each time, not a growing file


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_a_hard_linked_old_log_is_not_truncated_through_the_link(tiny, tmp_path):
    base, _ = tiny
    out = tmp_path / "fam"
    assert _quantize_process(base, out).returncode == 0
    keep = tmp_path / "kept.log"
    os.link(out / "quantize.log", keep)  # someone kept the old log under another name
    old = keep.read_bytes()
    p = _quantize_process(base, out, "--force")
    assert p.returncode == 0, p.stderr
    assert keep.read_bytes() == old and not os.path.samefile(keep, out / "quantize.log")


def test_calibrate_activations_starts_the_log_afresh(fam):
    (fam / "quantize.log").write_bytes(b"an old run\n" * 200_000)  # 2.2 MB from earlier runs
    r = cli(["calibrate-activations", "--family", fam, "--tokens", "64", "--chunk", "64", "--json"])
    assert r.exit_code == 0, r.stderr
    text = (fam / "quantize.log").read_text()
    assert "an old run" not in text and len(text) < 1_000_000


def test_a_planted_log_link_is_still_refused_by_calibrate_activations(fam, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (fam / "quantize.log").symlink_to(victim)
    before = snapshot(fam)
    r = cli(["calibrate-activations", "--family", fam, "--tokens", "64"])
    assert_clean_error(r, 1, "quantize.log is a symbolic link")
    assert victim.read_text() == "precious\n" and without(snapshot(fam), ".specquant.lock") == before


# -- a timing no machine measures --------------------------------------------------------------------------------------
@pytest.mark.parametrize("step", [5e-324, 1e-9, 1e-300])
def test_a_calibration_with_an_impossible_timing_is_refused(step):
    from specquant_cli.system.calibration_file import entry_problem

    entry = {"parent_call_s": {"1": step}, "draft_step_s": {}, "prefill_token_s": {}, "agreement": {},
             "tokens_per_cycle": {}, "draft_pair_s": {}, "fingerprint": {}, "measured_at": "", "left_out": [],
             "draft_call_s": {}, "deep_call_s": {}, "deep_pos": 0, "import_s": {}}
    assert "not a timing" in entry_problem(entry)
