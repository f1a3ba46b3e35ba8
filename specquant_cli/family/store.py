"""Families by name: `--family NAME` finds a family pulled or quantized earlier wherever a command runs, `list` shows
every one known, and a command that names none runs the default one.

A family is a folder (family.manifest); a name is its folder's name. A name is looked up, in this order, in:

1. `./models` of the current folder (a specquant checkout's, where its scripts pull: a checkout's own families come
   first there);
2. the models folder (the `runtime.models` setting; by default specquant's user data folder,
   `~/.local/share/specquant/models`): families made there, one sub-folder each;
3. the models folder's index (`families.json`): families pulled or quantized elsewhere (a checkout's `./models`, a
   folder given to quantize), name -> absolute folder, and the default family.

Where a new family is made (`destination`): the models folder when the setting names one; else `./models` when it
is a checkout's (the current folder holds specquant_cli/, or ./models already holds a family), so that a checkout's
`models/…` paths keep working; else the models folder. Either way pull and quantize add it to the index
(`remember`), so every command finds it by name from any folder.

One family per name (the index keeps one folder per name): quantize refuses a new family whose name another family
known already has (`holder`) unless --force, and `remember` says when a name moves to another folder. What quantize
takes as a name and what as a folder (`target`): a plain word is a name; a path is the folder it names; '.' and '..'
are neither (`dot_problem`); a value no folder can have is one line (`ref_problem`).

The default family (`default_family`), when nothing names one: the index's default (the family pulled or quantized
last); else, of the families known, the one made last (its manifest written last). The test family (TEST_FAMILY:
the set-up scripts pull it on every run) is never the default while another family is known: pull and quantize do
not record it as the default then, and one recorded earlier gives way. Name it (`--family`, SPECQUANT_FAMILY,
`[runtime] family`) to run it.

Nothing on disk is trusted: an index that is no JSON object of ours is a warning and is replaced by the next record,
an entry that is no family name and absolute folder, or whose folder holds no family, is skipped, and the index is
written atomically under a lock (flock on `.families.lock`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from specquant_cli.errors import FamilyError, InputError
from specquant_cli.fsutil import write_json_atomic
from specquant_cli.names import MANIFEST

INDEX = "families.json"  # in the models folder
INDEX_LOCK = ".families.lock"
LOCAL = "models"  # a checkout's models folder, in the current folder
TEST_FAMILY = "smollm2-135m"  # family.fetch's small family for tests and the quick demo
SCHEMA = 1
MAX_INDEX_BYTES = 1 << 20  # an index is a line per family
LOCK_WAIT_S = 10.0  # the longest wait for the index's lock
NAME_MAX = 255  # bytes in one file name (Linux): a family's name is its folder's name
PATH_MAX = 4095  # bytes in a path the OS takes
WHERE = ("./models", "models folder", "index")  # Known.where, in the order a name is looked up

Warn = Callable[[str], None]


def _silent(text: str) -> None:
    pass


@dataclass(frozen=True)
class Known:
    """A family found by name: its name, its folder (absolute), and where it was found (one of WHERE)."""

    name: str
    root: Path
    where: str


@dataclass
class Index:
    """The models folder's index: name -> absolute family folder, and the default family's folder (None: none)."""

    families: dict[str, Path] = field(default_factory=dict)
    default: Optional[Path] = None


def is_name(ref) -> bool:
    """`ref` (a --family value) is a plain name: one path component, no folder of its own ('.', '..')."""
    text = str(ref)
    return bool(text) and "/" not in text and os.sep not in text and text not in (".", "..") and "\0" not in text


def is_family(folder: Path) -> bool:
    """`folder` holds a manifest (whether it checks out is Family.load's to say)."""
    try:
        return os.path.lexists(Path(folder) / MANIFEST)
    except (OSError, ValueError):
        return False


def ref_problem(ref, label: str = "family") -> Optional[str]:
    """Why a --family value can name no folder on this system (a part longer than a file name may be: NAME_MAX bytes;
    or a path longer than PATH_MAX), as one line naming it after `label`, else None: the OS would refuse it with an
    error that names no option."""
    raw = os.fsencode(str(ref))
    longest = max((len(part) for part in raw.split(b"/")), default=0)
    if longest <= NAME_MAX and len(raw) <= PATH_MAX:
        return None
    text = str(ref)
    shown = repr(text if len(text) <= 48 else text[:40] + "…")
    if longest > NAME_MAX:
        return (f"{label} {shown} ({len(text)} characters): a name of {longest} bytes; a family's name is its "
                f"folder's name, at most {NAME_MAX} bytes")
    return f"{label} {shown}: a path of {len(raw)} bytes; at most {PATH_MAX}"


def dot_problem(ref) -> Optional[str]:
    """Why a --family value names no family to make (quantize): '.', '..' or a path ending in one is the folder here
    or one above, no family's own folder and no name (a family made there would take that folder's name, and its
    files would land among whatever the folder holds), else None."""
    if not str(ref):
        return "--family '': empty; give a name (--family my-model) or the family's folder (--family ./my-model)"
    text = str(ref).rstrip("/") or "/"
    if text == "/" or os.path.basename(text) in (".", ".."):
        folder = _absolute(Path(text))
        return (f"--family {ref}: names the folder {folder}, not a family; give a name (--family my-model) or the "
                f"family's own folder as a path (--family {folder / 'my-model'})")
    return None


def _absolute(folder: Path) -> Path:
    return Path(os.path.abspath(folder))


def _families_in(folder: Optional[Path]) -> list[tuple[str, Path]]:
    """(name, folder) of each family folder directly in `folder`, by name (hidden work folders skipped)."""
    if folder is None:
        return []
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return []
    return [(e.name, _absolute(Path(e.path))) for e in entries
            if not e.name.startswith(".") and _is_dir(e) and is_family(Path(e.path))]


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def current_folder() -> Optional[Path]:
    """The current folder (None when it was removed)."""
    try:
        return Path.cwd()
    except OSError:
        return None


def local_models(cwd: Optional[Path]) -> Optional[Path]:
    """./models of `cwd` when it is a folder (None without a current folder)."""
    if cwd is None:
        return None
    folder = Path(cwd) / LOCAL
    return folder if folder.is_dir() else None


def is_checkout(cwd: Optional[Path]) -> bool:
    """`cwd` is a specquant checkout (its package folder is there)."""
    return cwd is not None and (Path(cwd) / "specquant_cli" / "__init__.py").is_file()


def destination(store: Optional[Path], cwd: Optional[Path], store_given: bool) -> Path:
    """The folder a new family is made in (see the module's docstring): the models folder when `store_given`
    (the setting was set), else a checkout's ./models (a relative path: `models/NAME`, as before), else the
    models folder. FamilyError when there is neither (no home folder)."""
    if not store_given:
        local = local_models(cwd)
        if (local is not None and _families_in(local)) or is_checkout(cwd):
            return Path(LOCAL)
    if store is None:
        raise FamilyError("no models folder: there is no home folder; set SPECQUANT_MODELS (or [runtime] models "
                          "in specquant.toml) to a folder for families")
    return store


# -- the index -------------------------------------------------------------------------------------------------------
def read_index(store: Optional[Path], warn: Warn = _silent) -> Index:
    """The models folder's index, its usable entries only; an index that cannot be used is a warning (`warn`) and
    reads as empty."""
    if store is None:
        return Index()
    path = Path(store) / INDEX
    try:
        data = _read_object(path)
    except FileNotFoundError:
        return Index()
    except (OSError, ValueError) as e:
        warn(f"{path}: ignored the index of families ({getattr(e, 'strerror', None) or e}); the next pull or "
             "quantize writes it again")
        return Index()
    families = data.get("families")
    index = Index()
    for name, folder in (families.items() if isinstance(families, dict) else ()):
        if is_name(name) and isinstance(folder, str) and "\0" not in folder and os.path.isabs(folder):
            index.families[name] = Path(folder)
    default = data.get("default")
    if isinstance(default, str) and "\0" not in default and os.path.isabs(default):
        index.default = Path(default)
    return index


def _read_object(path: Path) -> dict:
    """A JSON object of ours from a regular file (no link), at most MAX_INDEX_BYTES; ValueError/OSError else."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_size > MAX_INDEX_BYTES:
        raise ValueError(f"{st.st_size} bytes, too large for an index")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 at byte {e.start}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError("not an index of families (schema 1)")
    return data


@contextlib.contextmanager
def _locked(store: Path) -> Iterator[None]:
    """Hold the index's lock (flock: the kernel drops it when its holder dies), waiting at most LOCK_WAIT_S for it
    (a holder keeps it for one read and write; OSError past that: a stopped process holds it); the folder is made
    when missing."""
    store.mkdir(parents=True, exist_ok=True)
    fd = os.open(store / INDEX_LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC, 0o666)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(errno.EWOULDBLOCK, f"another process holds {INDEX_LOCK}") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def remember(store: Path, root: Path, cwd: Optional[Path], default: bool = True, warn: Warn = _silent) -> bool:
    """Add the family at `root` to the index under its folder's name, and make it the default family when
    `default` — unless it is the test family and another family is known. Entries whose folder holds no family
    any more are dropped; an entry of that name for another family is replaced, said through `warn` (quantize
    asks for --force first: `holder`). Returns whether it is the default now. OSError when the index cannot be
    written."""
    root = _absolute(root)
    with _locked(Path(store)):
        index = read_index(store)
        was = index.families.get(root.name)
        if was is not None and is_family(was) and os.path.realpath(was) != os.path.realpath(root):
            warn(f"the name {root.name} now runs {root}; the family at {was} keeps its folder and runs by it: "
                 f"--family {was}")
        index.families = {n: f for n, f in index.families.items() if is_family(f) and f != root}
        index.families[root.name] = root
        real = os.path.realpath(root)
        others = [k for k in known(store, cwd, index) if os.path.realpath(k.root) != real]
        if default and not (root.name == TEST_FAMILY and others):
            index.default = root
        if index.default is not None and not is_family(index.default):
            index.default = None
        write_json_atomic(Path(store) / INDEX, {
            "schema": SCHEMA, "default": str(index.default) if index.default else None,
            "families": {n: str(f) for n, f in sorted(index.families.items())}})
        return index.default == root


# -- finding families ------------------------------------------------------------------------------------------------
def known(store: Optional[Path], cwd: Optional[Path], index: Optional[Index] = None,
          warn: Warn = _silent) -> list[Known]:
    """Every family found: ./models, the models folder, the index (WHERE), each folder once (the first place that
    names it)."""
    index = read_index(store, warn) if index is None else index
    found: list[Known] = []
    seen: set[str] = set()
    places = (_families_in(local_models(cwd)), _families_in(store),
              [(n, f) for n, f in sorted(index.families.items()) if is_family(f)])
    for where, pairs in zip(WHERE, places):
        for name, folder in pairs:
            real = os.path.realpath(folder)
            if real not in seen:
                seen.add(real)
                found.append(Known(name, folder, where))
    return found


def find(name: str, store: Optional[Path], cwd: Optional[Path], warn: Warn = _silent) -> Optional[Path]:
    """The folder of the family named `name` (the first in WHERE's order), or None."""
    for k in known(store, cwd, warn=warn):
        if k.name == name:
            return k.root
    return None


def holder(root: Path, store: Optional[Path], cwd: Optional[Path]) -> Optional[Known]:
    """Another family known by the name of the folder `root` (one in another folder), or None: a family made at
    `root` would take the name from it (the index keeps one folder per name)."""
    real = os.path.realpath(root)
    name = _absolute(root).name
    return next((k for k in known(store, cwd) if k.name == name and os.path.realpath(k.root) != real), None)


def made_from(root: Path) -> str:
    """The base file the family at `root` was made from, as its manifest records it ("another base" when it does
    not say)."""
    from specquant_cli.family.manifest_file import read_existing

    old, _ = read_existing(Path(root))
    base = old.get("base") if old else None
    file = base.get("file") if isinstance(base, dict) else None
    return file if isinstance(file, str) and file else "another base"


def locate(ref: Path | str, store: Optional[Path], cwd: Optional[Path], warn: Warn = _silent) -> Path:
    """The folder a --family value names: a folder holding a family, as given; else a plain name found by `find`;
    else, for a plain name that is no folder here either, FamilyError naming the families known (and, for a name
    the index records at a folder that holds no family now, that folder); else the path as given (Family.load says
    what is wrong with it). FamilyError for a value no folder can have (ref_problem)."""
    why = ref_problem(ref)
    if why:
        raise FamilyError(why)
    ref = Path(ref)
    if is_family(ref) or not is_name(ref):
        return ref
    found = find(str(ref), store, cwd, warn)
    if found is not None:
        return found
    if os.path.lexists(ref):
        return ref
    names = sorted({k.name for k in known(store, cwd)})
    have = f"known: {', '.join(names)} (specquant list)" if names else "none is pulled yet"
    gone = read_index(store).families.get(str(ref))
    if gone is not None:
        raise FamilyError(f"no model family named {str(ref)!r} now: the index ({Path(store) / INDEX}) records it at "
                          f"{gone}, which {'holds no family' if os.path.isdir(gone) else 'is gone'} (moved or "
                          f"removed); run it by its new folder (--family DIR), or make it again with: specquant "
                          f"quantize FILE --family {ref}" + (f"; known: {', '.join(names)}" if names else ""))
    raise FamilyError(f"no model family named {str(ref)!r} ({have}); fetch one with: specquant pull NAME "
                      f"({', '.join(_demo_names())}), or make one with: specquant quantize FILE --family NAME")


def target(ref: Optional[Path | str], name: str, store: Optional[Path], cwd: Optional[Path], store_given: bool) -> Path:
    """The folder quantize makes a family in (or adds to), by docs/models.md's rules: `ref` (its --family) when it
    is a folder holding a family, or a path (a value with a '/'); a plain name, or none (`name`, the base's): the
    family of that name (`find`), else a new folder of that name in the `destination` (a folder of that name here
    that holds no family is not it: a name is looked up where names are). InputError for a value that names no
    family to make (ref_problem, dot_problem: '.', '..')."""
    if ref is not None:
        from specquant_cli.settings import settings_table

        why = ref_problem(ref, settings_table()["runtime.family"].flag) or dot_problem(ref)
        if why:
            raise InputError(why)
        if is_family(ref) or not is_name(ref):
            return Path(ref)
    key = str(ref) if ref is not None else name
    found = find(key, store, cwd)
    return found if found is not None else destination(store, cwd, store_given) / key


def _demo_names() -> list[str]:
    from specquant_cli.family.fetch import FAMILIES

    return list(FAMILIES)


def made_at(root: Path) -> int:
    """When the family's manifest was last written (ns; 0 when it cannot be read)."""
    try:
        return os.lstat(Path(root) / MANIFEST).st_mtime_ns
    except OSError:
        return 0


def default_family(store: Optional[Path], cwd: Optional[Path], warn: Warn = _silent) -> tuple[Path, str]:
    """The default family's folder and why it is the one (see the module's docstring); FamilyError when no family
    is known."""
    index = read_index(store, warn)
    fams = known(store, cwd, index)
    if not fams:
        where = ", ".join([f"./{LOCAL}", *([str(store)] if store is not None else [])])
        raise FamilyError(f"no model family found (none in {where}); fetch the test family with: specquant pull "
                          f"{TEST_FAMILY} (or {', '.join(n for n in _demo_names() if n != TEST_FAMILY)})")
    others = [k for k in fams if k.name != TEST_FAMILY]
    recorded = index.default
    if recorded is not None and is_family(recorded) and not (recorded.name == TEST_FAMILY and others):
        return recorded, "pulled or quantized last"
    if len(fams) == 1:
        return fams[0].root, "the only family found"
    pick = max(others or fams, key=lambda k: (made_at(k.root), k.name))
    return pick.root, "made last" + (f"; {TEST_FAMILY} is the test family, run only when named" if others else "")
