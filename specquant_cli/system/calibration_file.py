"""The stored calibrations: one file per family (`calibration.json` in its folder, or in the user cache when the
folder cannot be written), an entry per machine keyed by its fingerprint (CPU, cores, threads, GPUs, the
llama-cpp-python version, RPC workers, the parent's rendering, this schema), every entry checked on every read —
keys, types, finite timings within bounds, agreements and acceptances in [0, 1] — and a bad one never used."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError
from specquant_cli.family.roles import is_role_name
from specquant_cli.fsutil import create_temp, write_json_atomic
from specquant_cli.names import CALIBRATION
from specquant_cli.settings import cores, deterministic
from specquant_cli.system.calibration import (
    DEEP_PARENT_SIZES,
    DRAFT_BATCH,
    LONG_CALLS,
    MAX_BATCH,
    PREFILL_TOKENS,
    RENDERING_SIZES,
    Calibration,
)

CALIBRATION_FILE = CALIBRATION
SCHEMA = 8  # part of the cache key: an entry measured by an older version is measured again
MAX_DEEP_POS = 1 << 20  # a stored deep position beyond this is not one any context holds


def fingerprint(facts, threads: Optional[int] = None, rpc: Optional[list[str]] = None,
                parent: Optional[str] = None) -> dict:
    """What a calibration depends on; a parent on RPC workers is calibrated per worker set (`rpc` endpoints), and
    each rendering of the parent (`parent`: f16, bf16) on its own. `threads`: as resolved (settings: never 0); None
    stands for every core."""
    from importlib.metadata import version

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"schema": SCHEMA, "cpu": model, "cores": facts.cores_logical,
            "threads": threads or cores(),
            "gpus": [g.name for g in facts.gpus], "gpu_offload": facts.gpu_offload,
            "llama_cpp_python": version("llama-cpp-python"), **({"rpc": sorted(rpc)} if rpc else {}),
            "parent": parent or "f16", **({"deterministic": True} if deterministic() else {})}


def key_of(fp: dict) -> str:
    return json.dumps(fp, sort_keys=True)


def _schema_of(key: str):
    try:
        fp = json.loads(key)
        return fp.get("schema") if isinstance(fp, dict) else None
    except ValueError:
        return None


# -- the stored entries: checked on every read ------------------------------------------------------------
MAX_FILE_BYTES = 4 << 20  # an entry is a few KB: a calibration file larger than this is not one
MAX_SECONDS = 600.0  # no single call measured here takes ten minutes: a larger timing is not a measurement
MIN_SECONDS = 1e-6  # nor does any take under a microsecond (a rate from a smaller one overflows)
FIELDS = {  # every key an entry holds, and what its value must be
    "parent_call_s": "object", "draft_step_s": "object", "prefill_token_s": "object", "agreement": "object",
    "tokens_per_cycle": "object", "draft_pair_s": "object", "fingerprint": "object", "measured_at": "string",
    "left_out": "array", "draft_call_s": "object", "deep_call_s": "object", "deep_pos": "number",
    "far_call_s": "object", "far_pos": "number", "import_s": "object", "renderings": "object",
}
# what an entry may leave out: a family of one rendering compares none; an entry stored before the far calls were
# measured holds none (it loads, priced along the deep figures; `specquant calibrate` measures them)
OPTIONAL = {"renderings": {}, "far_call_s": {}, "far_pos": 0}
_TOL = 1e-3  # the stored run lengths are rounded to 4 decimals


def _json_type(v) -> str:
    if isinstance(v, dict):
        return "object"
    if isinstance(v, list):
        return "array"
    if isinstance(v, str):
        return "string"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return "null" if v is None else type(v).__name__


def _number(v, what: str) -> float:
    """A finite JSON number (not a boolean), else ValueError naming `what`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{what} is a {_json_type(v)}, not a number")
    try:
        x = float(v)
    except OverflowError:
        raise ValueError(f"{what} is out of range") from None
    if not math.isfinite(x):
        raise ValueError(f"{what} is {x}, not a finite number")
    return x


def _seconds(v, what: str) -> float:
    x = _number(v, what)
    if not MIN_SECONDS <= x <= MAX_SECONDS:
        raise ValueError(f"{what} {x:g} s is not a timing (must be {MIN_SECONDS:g} .. {MAX_SECONDS:g} s)")
    return x


def _roles(d: dict, field_name: str) -> None:
    for role in d:
        if not is_role_name(role):
            raise ValueError(f"{field_name} names the role {role[:40]!r}, which is not a role name")


def entry_problem(entry) -> Optional[str]:
    """Why a stored entry cannot be used (its keys, types and values), or None when it can."""
    try:
        _check_entry(entry)
    except ValueError as e:
        return str(e)
    return None


def _check_entry(entry) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"a JSON {_json_type(entry)}, not an object")
    entry = {**OPTIONAL, **entry}
    missing = [k for k in FIELDS if k not in entry]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing")
    for k, want in FIELDS.items():
        if _json_type(entry[k]) != want:
            raise ValueError(f"{k} is a JSON {_json_type(entry[k])}, not an {want}" if want[0] in "aeiou"
                             else f"{k} is a JSON {_json_type(entry[k])}, not a {want}")
    calls = entry["parent_call_s"]
    sizes = []
    for k, v in calls.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 3 and (1 <= int(k) <= MAX_BATCH or int(k) in LONG_CALLS)):
            raise ValueError(f"parent_call_s has the call size {k[:20]!r}, not one of 1..{MAX_BATCH}, "
                             f"{', '.join(map(str, LONG_CALLS))}")
        sizes.append(int(k))
        _seconds(v, f"parent_call_s[{k}]")
    short = sorted(n for n in sizes if n <= MAX_BATCH)  # the long calls come on top of all the short ones, or none
    if short != list(range(1, len(short) + 1)) or (len(short) < MAX_BATCH and len(short) < len(sizes)):
        raise ValueError(f"parent_call_s sizes {sorted(sizes)} are not 1..N" if sizes else "parent_call_s is empty")
    for name in ("draft_step_s", "prefill_token_s", "draft_pair_s"):
        _roles(entry[name], name)
        for role, v in entry[name].items():
            _seconds(v, f"{role} {name}")
    _roles(entry["agreement"], "agreement")
    for role, v in entry["agreement"].items():
        x = _number(v, f"{role} agreement")
        if not 0 <= x <= 1:
            raise ValueError(f"{role} agreement {x:g} outside [0, 1]")
    _roles(entry["tokens_per_cycle"], "tokens_per_cycle")
    for role, runs in entry["tokens_per_cycle"].items():
        if not isinstance(runs, list) or len(runs) > MAX_BATCH - 1:
            raise ValueError(f"{role} tokens_per_cycle is not a list of at most {MAX_BATCH - 1} numbers")
        prev = 1.0  # E(g) - E(g-1) is the share of positions whose run reaches g: an acceptance, in [0, 1]
        for g, v in enumerate(runs, 1):
            x = _number(v, f"{role} tokens_per_cycle[{g}]")
            if not -_TOL <= x - prev <= 1 + _TOL:
                raise ValueError(f"{role} tokens_per_cycle[{g}] = {x:g} after {prev:g}: an acceptance of "
                                 f"{x - prev:g}, outside [0, 1]")
            prev = x
    if not all(isinstance(r, str) for r in entry["left_out"]):
        raise ValueError("left_out holds something other than role names")
    deep_pos = _check_deep_pos(entry["deep_pos"])
    _check_curves(entry, "draft_call_s", range(1, DRAFT_BATCH + 1))
    _check_curves(entry, "deep_call_s", DEEP_PARENT_SIZES)
    if entry["deep_call_s"] and not deep_pos:
        raise ValueError("deep_call_s holds timings but deep_pos is 0 (not measured)")
    far_pos = _check_deep_pos(entry["far_pos"], "far_pos")
    _check_curves(entry, "far_call_s", DEEP_PARENT_SIZES)
    if entry["far_call_s"] and not far_pos:
        raise ValueError("far_call_s holds timings but far_pos is 0 (not measured)")
    if far_pos and far_pos <= deep_pos:
        raise ValueError(f"far_pos {far_pos} is not beyond deep_pos {deep_pos}")
    _check_curves(entry, "import_s", range(1, max(PREFILL_TOKENS, deep_pos) + 1))
    _check_renderings(entry["renderings"])


def _check_renderings(d: dict) -> None:
    """renderings: f16/bf16 -> {"prefill_token_s": seconds, "call_s": {size in RENDERING_SIZES: seconds}}."""
    from specquant_cli.family.roles import RENDERINGS

    for r, t in d.items():
        if r not in RENDERINGS:
            raise ValueError(f"renderings names {r[:40]!r}, not one of {', '.join(RENDERINGS)}")
        if not isinstance(t, dict) or set(t) != {"prefill_token_s", "call_s"} or not isinstance(t["call_s"], dict):
            raise ValueError(f"renderings[{r}] is not an object of prefill_token_s and call_s")
        _seconds(t["prefill_token_s"], f"renderings[{r}] prefill_token_s")
        for k, v in t["call_s"].items():
            if not (k.isascii() and k.isdigit() and len(k) <= 3 and int(k) in RENDERING_SIZES):
                raise ValueError(f"renderings[{r}] has the call size {k[:20]!r}, not one of {_span(RENDERING_SIZES)}")
            _seconds(v, f"renderings[{r}] call_s[{k}]")


def _check_deep_pos(v, name: str = "deep_pos") -> int:
    """deep_pos (or far_pos): a whole number of positions, 0 (not measured) .. MAX_DEEP_POS."""
    x = _number(v, name)
    if not 0 <= x <= MAX_DEEP_POS or x != int(x):
        raise ValueError(f"{name} {x:g} is not a position (a whole number 0 .. {MAX_DEEP_POS})")
    return int(x)


def _check_curves(entry: dict, name: str, sizes) -> None:
    """entry[name]: role -> {size as a digit string, one of `sizes`: seconds}."""
    _roles(entry[name], name)
    for role, curve in entry[name].items():
        if not isinstance(curve, dict):
            raise ValueError(f"{role} {name} is a JSON {_json_type(curve)}, not an object")
        for k, v in curve.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 8 and int(k) in sizes):
                raise ValueError(f"{role} {name} has the size {k[:20]!r}, not one of {_span(sizes)}")
            _seconds(v, f"{role} {name}[{k}]")


def _span(sizes) -> str:
    """How a set of allowed sizes reads in a message: 1..8, or 1, 4, 8."""
    return f"{sizes.start}..{sizes.stop - 1}" if isinstance(sizes, range) else ", ".join(map(str, sizes))


def _read(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """A calibration file's entries ({} when there is none), or None and why it cannot be used."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return None, f"{path} cannot be read ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return None, f"{path} is not a regular file"
    if st.st_size > MAX_FILE_BYTES:
        return None, (f"{path} is {st.st_size / 2**20:.1f} MiB, larger than any calibration file "
                      f"(limit {MAX_FILE_BYTES >> 20} MiB)")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        return None, f"{path} cannot be read ({e.strerror})"
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"{path} is not UTF-8 text (invalid byte at offset {e.start})"
    except json.JSONDecodeError as e:
        return None, f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except (ValueError, RecursionError) as e:
        return None, f"{path} is not valid JSON ({type(e).__name__})"
    if not isinstance(data, dict):
        return None, f"{path} holds a JSON {_json_type(data)}, not an object of entries"
    return data, None


def _same_machine_older(data: dict, fp: dict) -> Optional[int]:
    """The schema of an entry for this machine measured by another version, if there is one."""
    for k in data:
        try:
            other = json.loads(k)
        except ValueError:
            continue
        if isinstance(other, dict) and other.get("schema") != fp.get("schema") and \
                {**other, "schema": None} == {**fp, "schema": None}:
            return other.get("schema")
    return None


# -- where the entries live: the family folder, or the user's cache when the family cannot be written -----
def cache_dir() -> Optional[Path]:
    """The calibrations' folder in specquant's user cache (settings.cache_home); None when there is no home."""
    from specquant_cli.settings import cache_home

    home = cache_home()
    return home / "calibrations" if home is not None else None


def _base_sha(root: Path) -> str:
    try:
        m = json.loads((Path(root) / "manifest.json").read_text(encoding="utf-8"))
        sha = m.get("base", {}).get("sha256") if isinstance(m, dict) and isinstance(m.get("base"), dict) else None
        return sha if isinstance(sha, str) else ""
    except (OSError, ValueError):
        return ""


def cache_file(root: Path) -> Optional[Path]:
    """The user-cache file for a family that cannot keep its calibration itself: keyed by the folder's real
    path and the sha256 of the family's base (a different family later at the same path gets its own)."""
    folder = cache_dir()
    if folder is None:
        return None
    real = os.path.realpath(root)
    key = hashlib.sha256(f"{real}\0{_base_sha(root)}".encode("utf-8", "surrogateescape")).hexdigest()[:32]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(real))[:64].lstrip(".") or "family"
    return folder / f"{name}-{key}.json"


def _places(root: Path) -> list[Path]:
    cached = cache_file(root)
    return [Path(root) / CALIBRATION_FILE] + ([cached] if cached else [])


def cannot_write(folder: Path, create: bool = False) -> Optional[str]:
    """Why no new file can be made in `folder` (a probe file is created and removed), or None when one can.
    The single place writability is decided (the tests make a folder read-only here)."""
    try:
        if create:
            os.makedirs(folder, exist_ok=True)
        fd, probe = create_temp(Path(folder) / "write-probe")
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    try:
        probe.unlink()
    except OSError:
        pass
    return None


def save_target(root: Path) -> Path:
    """The file a new measurement will be saved in: the family's own, else the user-cache one; an InputError
    (before anything is measured) when neither can be written."""
    why = cannot_write(Path(root))
    if why is None:
        return Path(root) / CALIBRATION_FILE
    cached = cache_file(root)
    if cached is None:
        raise InputError(f"cannot save a calibration: the family folder {root} is not writable ({why}) and there "
                         "is no user cache folder (set XDG_CACHE_HOME)")
    why_cache = cannot_write(cached.parent, create=True)
    if why_cache is not None:
        raise InputError(f"cannot save a calibration: the family folder {root} is not writable ({why}), nor is "
                         f"the cache folder {cached.parent} ({why_cache})")
    return cached


def load_checked(root: Path, fp: dict) -> tuple[Optional[Calibration], Optional[str]]:
    """This machine's entry, checked (keys, types, finite positive timings, agreements and acceptances in
    [0, 1]): from the family folder, else from the user cache. Returns (entry, None), or (None, why the
    stored entry was not used) — why is None when there simply is none."""
    key, why = key_of(fp), None
    for path in _places(root):
        data, problem = _read(path)
        if data is None:
            why = why or problem
            continue
        if key not in data:
            older = _same_machine_older(data, fp)
            if older is not None and why is None:
                why = (f"the stored entry for this machine ({path}) was measured by another version "
                       f"(calibration schema {older!r}, this version's is {SCHEMA})")
            continue
        entry = data[key]
        problem = entry_problem(entry)
        if problem:
            why = why or f"the stored entry for this machine ({path}) is invalid ({problem})"
            continue
        return Calibration.from_dict(entry), None
    return None, why


def load(root: Path, fp: dict) -> Optional[Calibration]:
    """This machine's valid entry, or None (an invalid one is never returned: see load_checked)."""
    return load_checked(root, fp)[0]


def save(root: Path, fp: dict, cal: Calibration) -> tuple[Path, Optional[str]]:
    """Add this fingerprint's entry, keeping the other valid entries of this schema (a family folder may move
    between machines); entries an older version measured, and broken ones, are dropped. Written in the
    family folder, or in the user cache when the family folder cannot be written. Returns the file written
    and, when that is the cache, why the family folder could not take it. OSError when neither could."""
    cal.fingerprint = fp
    last: Optional[OSError] = None
    for i, path in enumerate(_places(root)):
        try:
            if i:
                os.makedirs(path.parent, exist_ok=True)
            data, _ = _read(path)
            data = {k: v for k, v in (data or {}).items() if _schema_of(k) == SCHEMA and entry_problem(v) is None}
            data[key_of(fp)] = cal.to_dict()
            write_json_atomic(path, data)
            return path, (None if last is None else (last.strerror or str(last)))
        except OSError as e:
            last = last or e
    raise last if last is not None else OSError(errno.EROFS, "nowhere to save the calibration")
