"""The user's tile cache: tiles measured by ``ce-bench tune --shapes NxHxV`` for one exact problem.

The tuned table (:mod:`ce_pallas_tpu.tuned`) holds tiles per shape *bucket*, measured at the bucket's
example shape; a user's own shape between examples gets the bucket's tiles or inferred ones. ``ce-bench
tune --shapes NxHxV --target <gen>`` measures candidate tiles at that exact problem (libtpu's static
schedule, no TPU needed) and writes the winner here; the backend then uses it for that problem, ahead
of the table (explicit ``BlockSizes`` still come first).

The cache is one JSON file:

* ``$CE_PALLAS_TPU_TILE_CACHE`` when set (``off`` or an empty value: no cache at all), else
* ``$XDG_CACHE_HOME/ce_pallas_tpu/tiles.json``, else ``~/.cache/ce_pallas_tpu/tiles.json``.

An entry is keyed by generation, problem (``N`` tokens per device, ``H``, ``V``), the dtypes of ``x``
and ``w`` and the objective (``loss``, or ``rl``: log-probs with the entropy). It records the libtpu
and ce_pallas_tpu versions it was measured with; when either differs from what is installed now, the
entry is *stale*: it is ignored (a warning says so, once) and the table or inference decides, as if
it were not there. A file that cannot be read is ignored the same way: a cache never breaks a step.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ce_pallas_tpu.tile_types import KernelTiles, TunedEntry

#: Where the cache file is (a path), or ``off`` for none.
CACHE_ENV = "CE_PALLAS_TPU_TILE_CACHE"
#: Version of the file's layout; a file of another version is ignored.
FORMAT = 1
OBJECTIVES = ("loss", "rl")


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """What a cached entry is for: one problem on one generation."""

    generation: str
    n: int
    h: int
    v: int
    x_dtype: str
    w_dtype: str
    objective: str = "loss"

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")

    @property
    def label(self) -> str:
        return f"{self.generation} {self.n}x{self.h}x{self.v} {self.x_dtype}/{self.w_dtype} {self.objective}"


@dataclasses.dataclass(frozen=True)
class CachedEntry:
    """One cached entry: the tiles (a :class:`TunedEntry` with the measured figures) and the versions."""

    key: CacheKey
    entry: TunedEntry
    libtpu: str
    ce_pallas_tpu: str
    measured_at: str = ""

    def stale_because(self, versions: Mapping[str, str]) -> str | None:
        """Why the entry no longer applies under the installed ``versions`` (None: it applies)."""
        for name, recorded in (("libtpu", self.libtpu), ("ce_pallas_tpu", self.ce_pallas_tpu)):
            if versions[name] != recorded:
                return f"measured with {name} {recorded}, installed is {versions[name]}"
        return None


def installed_versions() -> dict[str, str]:
    """The versions an entry must match: libtpu's and ce-pallas-tpu's (``unknown`` when not installed)."""
    return {"libtpu": _version("libtpu"), "ce_pallas_tpu": _version("ce-pallas-tpu")}


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def cache_path() -> Path | None:
    """The cache file (None: the cache is turned off by ``CE_PALLAS_TPU_TILE_CACHE=off``)."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return None if configured.strip().lower() in ("", "off", "0", "none") else Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ce_pallas_tpu" / "tiles.json"


# ---------------------------------------------------------------------------------------------
# The file.


def _tiles_to_json(tiles: KernelTiles[int | None]) -> list[int | None]:
    return [tiles.block_b, tiles.block_h, tiles.block_v, tiles.w_buffers]


def _tiles_from_json(value: Any) -> KernelTiles[int | None]:
    block_b, block_h, block_v, w_buffers = value
    for size in (block_b, block_v):
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"bad tiles {value!r}")
    return KernelTiles(block_b, block_h, block_v, w_buffers)


_FIGURES = ("forward_ratio", "backward_ratio", "forward_hbm_us", "forward_mxu_us", "backward_hbm_us",
            "backward_mxu_us")


def entry_to_json(cached: CachedEntry) -> dict[str, Any]:
    record: dict[str, Any] = dataclasses.asdict(cached.key)
    record.update(forward=_tiles_to_json(cached.entry.forward), backward=_tiles_to_json(cached.entry.backward),
                  libtpu=cached.libtpu, ce_pallas_tpu=cached.ce_pallas_tpu, measured_at=cached.measured_at)
    record.update({name: getattr(cached.entry, name) for name in _FIGURES})
    return record


def entry_from_json(record: Mapping[str, Any]) -> CachedEntry:
    """One entry of the file (``ValueError``/``KeyError``/``TypeError`` when it is malformed)."""
    key = CacheKey(**{field.name: record[field.name] for field in dataclasses.fields(CacheKey)})
    entry = TunedEntry(forward=_tiles_from_json(record["forward"]), backward=_tiles_from_json(record["backward"]),
                       **{name: record.get(name) for name in _FIGURES})
    return CachedEntry(key, entry, str(record["libtpu"]), str(record["ce_pallas_tpu"]),
                       str(record.get("measured_at", "")))


def read_entries(path: Path) -> list[CachedEntry]:
    """Every entry of the file at ``path`` (``[]`` when there is none).

    Raises:
      ValueError: the file is not a cache of this format (the message says what is wrong).
    """
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a tile cache of format {FORMAT}")
        return [entry_from_json(record) for record in data["entries"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: {type(error).__name__}: {error}") from error


def write_entries(new: Iterable[CachedEntry], path: Path | None = None) -> Path:
    """Add ``new`` to the cache file (an entry of the same key is replaced), atomically, under a lock.

    Raises:
      ValueError: the cache is turned off, or the existing file is malformed (it is left as it is).
    """
    import fcntl
    import tempfile

    path = path or cache_path()
    if path is None:
        raise ValueError(f"the tile cache is turned off ({CACHE_ENV}=off): nothing can be written")
    path.parent.mkdir(parents=True, exist_ok=True)
    with (path.parent / (path.name + ".lock")).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = {cached.key: cached for cached in read_entries(path)}
        entries.update({cached.key: cached for cached in new})
        text = json.dumps({"format": FORMAT, "entries": [entry_to_json(cached) for cached in entries.values()]},
                          indent=1)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, encoding="utf-8") as file:
            file.write(text + "\n")
        os.replace(file.name, path)
    _read_cached.cache_clear()
    return path


def make_entry(key: CacheKey, entry: TunedEntry) -> CachedEntry:
    """``entry`` as measured now, with the installed versions."""
    versions = installed_versions()
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return CachedEntry(key, entry, versions["libtpu"], versions["ce_pallas_tpu"], now)


# ---------------------------------------------------------------------------------------------
# Looking an entry up (what the backend does when it plans a problem).


@functools.lru_cache(maxsize=8)
def _read_cached(path: Path, mtime_ns: int) -> tuple[dict[CacheKey, CachedEntry], str | None]:
    """The file's entries by key, read once per modification (and why it could not be read)."""
    del mtime_ns  # part of the cache key only: a rewritten file is read again
    try:
        return {cached.key: cached for cached in read_entries(path)}, None
    except ValueError as error:
        return {}, str(error)


@functools.lru_cache(maxsize=256)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def lookup(key: CacheKey) -> TunedEntry | None:
    """The cached tiles for ``key`` when the cache holds a fresh entry for it (None otherwise).

    A stale entry or an unreadable file gives None and a warning (once per message).
    """
    path = cache_path()
    if path is None:
        return None
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None  # no cache file: nothing was tuned
    entries, error = _read_cached(path, mtime)
    if error is not None:
        _warn_once(f"ce_pallas_tpu: the tile cache is ignored: {error}")
        return None
    cached = entries.get(key)
    if cached is None:
        return None
    why = cached.stale_because(installed_versions())
    if why is not None:
        _warn_once(f"ce_pallas_tpu: the cached tiles for {key.label} are stale ({why}) and are ignored; "
                   f"measure them again with `ce-bench tune --target {key.generation} --shapes "
                   f"{key.n}x{key.h}x{key.v}`")
        return None
    return cached.entry
