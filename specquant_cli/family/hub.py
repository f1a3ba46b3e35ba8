"""`hf:OWNER/REPO:QUANT` and `hf:OWNER/REPO/FILE.gguf` (llama.cpp's `-hf` convention; `hf:OWNER/REPO` alone means
its Q4_K_M, as llama.cpp's does, or its one GGUF): a file of a Hugging Face model repository, through the
huggingface_hub library — its cache (HF_HUB_CACHE, else $HF_HOME/hub), its token (HF_TOKEN or `hf auth login`), its
progress bars on stderr. A file already in the cache is used without a request (`try_to_load_from_cache`); offline
(HF_HUB_OFFLINE) nothing is asked of the network and the repository's files are those its cached snapshot of `main`
holds (`scan_cache_dir`). A model split into parts (`-00001-of-0000N.gguf`) is fetched whole; a part the repository or
the cache lacks is one line naming it."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError
from specquant_cli.family import gguf_split
from specquant_cli.family.located import Found, Located, Progress, family_name, gguf_type
from specquant_cli.settings import ModelStores

DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's -hf default
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
QUANT = re.compile(r"^[A-Za-z0-9_]+$")
FILE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9 ._+@()/-]*\.gguf$")


def parse(text: str, rest: str) -> tuple[str, str, str]:
    """(repo id, file or '', quant or '') of `hf:OWNER/REPO[:QUANT]` or `hf:OWNER/REPO/FILE.gguf`; InputError when
    malformed."""
    path, colon, quant = rest.partition(":")
    parts = path.split("/")
    ok = len(parts) >= 2 and NAME.match(parts[0]) and NAME.match(parts[1])
    if ok and len(parts) > 2:
        file = "/".join(parts[2:])
        ok = not colon and FILE.match(file) and ".." not in parts[2:] and "" not in parts[2:]
    else:
        file = ""
        ok = ok and (not colon or QUANT.match(quant))
    if not ok:
        raise InputError(f"{text}: malformed Hugging Face reference; write hf:OWNER/REPO:QUANT (e.g. "
                         "hf:bartowski/Qwen2.5-Coder-1.5B-Instruct-GGUF:Q8_0) or hf:OWNER/REPO/FILE.gguf")
    return f"{parts[0]}/{parts[1]}", file, quant


def locate(text: str, rest: str, stores: ModelStores, progress: Optional[Progress] = None) -> Located:
    repo, file, quant = parse(text, rest)
    if stores.hf_cache is None:
        raise InputError(f"{text}: no Hugging Face cache folder (set HF_HUB_CACHE or HF_HOME)")
    cached = _cached(repo, stores.hf_cache)
    listing = sorted(cached) if cached is not None else None
    names = _names(text, repo, file, quant, listing, pick_only=True) if listing is not None else None
    if names is None or not all(n in listing for n in names):  # not all in the cache: the Hub's listing
        offline_why = "HF_HUB_OFFLINE is set" if stores.hf_offline else None
        if not stores.hf_offline:
            listing, offline_why = _hub_listing(text, repo)
        if listing is None and cached is not None:
            listing = sorted(cached)
        if listing is None and not file:
            raise InputError(f"{text}: {repo} is not in the Hugging Face cache ({stores.hf_cache}), and {offline_why}"
                             "; fetch it once online, or name a file: hf:OWNER/REPO/FILE.gguf")
        names = _names(text, repo, file, quant, listing) if listing is not None else _all_parts(file)
    files = tuple(_fetch(text, repo, n, stores, part=(i + 1, len(names)) if len(names) > 1 else None)
                  for i, n in enumerate(names))
    ref = f"hf:{repo}/{names[0]}"
    split = gguf_split.PART.match(Path(names[0]).name) if len(names) > 1 else None
    stem = split["stem"] if split else Path(names[0]).name.removesuffix(".gguf")
    snapshot = files[0].parent.name if files[0].parent.parent.name == "snapshots" else "?"
    return Located(ref, family_name(stem), files, f"Hugging Face {repo}, {names[0]}"
                   f"{f' and its {len(names) - 1} other parts' if split else ''} at revision {snapshot}")


def _names(text: str, repo: str, file: str, quant: str, listing: list[str], pick_only: bool = False) -> \
        Optional[list[str]]:
    """The repository files the reference names in `listing`: the file (or the model of the quant), and every part of
    a split model. `pick_only`: None instead of an error when the listing (a cached snapshot) lacks them."""
    if not file:
        try:
            file = _pick(text, repo, listing, quant)
        except InputError:
            if pick_only:
                return None
            raise
    names = _all_parts(file)
    parts = names if len(names) > 1 else None
    missing = [n for n in names if n not in listing]
    if missing and pick_only:
        return None
    if missing and not parts:
        raise InputError(f"{text}: {repo} has no file {file}; its GGUFs: {_shown(_models(listing))}")
    if missing:
        raise InputError(f"{text}: a part of the split model is missing from {repo}: {missing[0]} (of {len(parts)})")
    return names


def _all_parts(file: str) -> list[str]:
    """`file`, or every part of the split model it is a part of, in order (in its folder of the repository)."""
    parts = gguf_split.parts_of(Path(file).name)
    return [str(Path(file).parent / p) if "/" in file else p for p in parts] if parts else [file]


def _hub_listing(text: str, repo: str) -> tuple[Optional[list[str]], Optional[str]]:
    """The repository's files as the Hub lists them, or (None, why) when the Hub cannot be reached."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        return HfApi().list_repo_files(repo), None
    except GatedRepoError:
        raise InputError(f"{text}: {repo} is gated; accept its terms on huggingface.co and log in "
                         "(hf auth login, or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise InputError(f"{text}: no repository {repo} on Hugging Face (or it is private: log in with "
                         "hf auth login, or set HF_TOKEN)") from None
    except Exception as e:  # no network, or the Hub failed: the cache may serve
        if not _is_network_error(e):
            raise
        return None, f"the Hub cannot be reached ({type(e).__name__})"


def _is_network_error(e: Exception) -> bool:
    """An error of reaching the Hub (connection, timeout, an HTTP failure, offline mode), not a bug of ours."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    return isinstance(e, (HfHubHTTPError, OfflineModeIsEnabled, OSError)) or \
        type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3")


def _cached(repo: str, cache: Path) -> Optional[dict[str, Path]]:
    """The files of the repository's cached snapshot (the one `main` points to, else the newest): relative name ->
    path; None when the cache holds no snapshot of it."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(cache)
    except (CacheNotFound, OSError):
        return None
    for r in info.repos:
        if r.repo_id == repo and r.repo_type == "model" and r.revisions:
            revs = sorted(r.revisions, key=lambda v: ("main" in v.refs, v.last_modified), reverse=True)
            rev = revs[0]
            return {str(f.file_path.relative_to(rev.snapshot_path)): f.file_path for f in rev.files}
    return None


def _models(listing: list[str]) -> list[str]:
    """The model files of a listing: GGUFs other than vision projectors and later split parts."""
    out = []
    for n in listing:
        base = Path(n).name
        m = gguf_split.PART.match(base)
        if base.endswith(".gguf") and not base.startswith("mmproj") and (m is None or int(m["no"]) == 1):
            out.append(n)
    return out


def _shown(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f", … ({len(names)} in all)" if len(names) > most else "") if names else "none"


def _pick(text: str, repo: str, listing: list[str], quant: str) -> str:
    """The model file of `quant` (the repository's Q4_K_M, or its one GGUF, when none is named)."""
    models = _models(listing)
    want = quant or DEFAULT_QUANT
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(want)}(?![A-Za-z0-9_])", re.IGNORECASE)
    hits = [n for n in models if pattern.search(Path(n).name)]
    if not hits and not quant and len(models) == 1:
        return models[0]
    if not hits:
        raise InputError(f"{text}: {repo} has no {want} GGUF; its GGUFs: {_shown(models)}")
    if len(hits) > 1:
        raise InputError(f"{text}: {repo} has {len(hits)} {want} GGUFs ({_shown(hits)}); name one: "
                         f"hf:{repo}/FILE.gguf")
    return hits[0]


def _fetch(text: str, repo: str, name: str, stores: ModelStores, part: Optional[tuple[int, int]]) -> Path:
    """The cached file `name` of the repository: used as cached when it is, else downloaded into the cache (its
    progress on stderr); offline, InputError when it is not cached."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError

    what = f"part {part[0]} of {part[1]} of the split model, {name}," if part else name
    cached = try_to_load_from_cache(repo, name, cache_dir=stores.hf_cache)
    if isinstance(cached, str):
        return Path(cached)
    try:
        return Path(hf_hub_download(repo, name, cache_dir=stores.hf_cache, local_files_only=stores.hf_offline))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if stores.hf_offline else "the Hub cannot be reached"
        raise InputError(f"{text}: {what} is not in the Hugging Face cache {stores.hf_cache}, and {why}") from None
    except EntryNotFoundError:
        raise InputError(f"{text}: {repo} has no file {name}") from None
    except GatedRepoError:
        raise InputError(f"{text}: {repo} is gated; accept its terms on huggingface.co and log in") from None
    except Exception as e:
        if not _is_network_error(e):
            raise
        raise InputError(f"{text}: {what} could not be downloaded ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None


def found(stores: ModelStores, warn: Callable[[str], None]) -> list[Found]:
    """The model GGUFs of every model repository in the cache (each one's snapshot of `main`, else its newest)."""
    if stores.hf_cache is None or not stores.hf_cache.is_dir():
        return []
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(stores.hf_cache)
    except (CacheNotFound, OSError) as e:
        warn(f"the Hugging Face cache {stores.hf_cache} cannot be read ({e})")
        return []
    out = []
    for r in sorted(info.repos, key=lambda r: r.repo_id):
        if r.repo_type != "model":
            continue
        files = _cached(r.repo_id, stores.hf_cache) or {}
        for name in _models(sorted(files)):
            names = _all_parts(name)
            if not all(n in files for n in names):
                continue
            size = sum(files[n].stat().st_size for n in names)
            out.append(Found(f"hf:{r.repo_id}/{name}", files[name], size, gguf_type(files[name])))
    return out
