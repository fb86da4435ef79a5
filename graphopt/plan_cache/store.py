"""Plans kept on disk between processes: JSON entries by key, safe under what training does.

- Each entry is one JSON file named by its key's SHA-256. Nothing is ever executed or
  unpickled from it: a reader takes numbers, strings and lists, and the pass that wrote it
  checks them against the graph it has before using them (passes/recompute/cached.py).
- Written atomically: to a temporary file in the same directory, then `os.replace`d into place,
  so a crash mid-write leaves no half entry and a reader sees the old file or the new one.
- Many ranks of one `torchrun` starting at once: `planning(key)` holds an exclusive lock on the
  key's lock file (fcntl.flock, released by the kernel if the process dies) while one of them
  plans; the others wait on it, then find the entry. Where the platform has no flock they plan
  too, and the last write wins, whole.
- A corrupt or truncated entry (not JSON, or not what the reader expects) is a `GraphoptWarning`
  and a miss: the plan is made again and the entry rewritten, never a crash.
- Bounded: after a write, the least recently used entries (by mtime, touched on each hit) are
  dropped while more than `max_entries` remain.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

from ..errors import GraphoptWarning, OptionError, warn

FORMAT = 1
MAX_ENTRIES = 256


def default_dir() -> Path:
    """$GRAPHOPT_CACHE_DIR, else $XDG_CACHE_HOME/graphopt, else ~/.cache/graphopt."""
    given = os.environ.get("GRAPHOPT_CACHE_DIR")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "graphopt"


def plan_store(plan_cache, dump_dir=None) -> "PlanStore | None":
    """optimize(plan_cache=...) as a store, or None where the cache is off: plan_cache=False, the
    default (True) where $GRAPHOPT_PLAN_CACHE=off (or 0, false, no), or a run that dumps."""
    if not isinstance(plan_cache, (bool, str, os.PathLike)):
        raise OptionError(f"plan_cache must be True, False or a directory, got {type(plan_cache).__name__}.")
    off = os.environ.get("GRAPHOPT_PLAN_CACHE", "").strip().lower() in ("off", "0", "false", "no")
    if plan_cache is False or (plan_cache is True and off) or dump_dir is not None:
        return None
    return PlanStore(None if plan_cache is True else plan_cache)


def digest(key: object) -> str:
    """The SHA-256 of a key's canonical JSON (sorted keys, no spaces): its entry's name."""
    text = json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class PlanStore:
    """Entries under `root/plans`, each a JSON object {"format", "kind", "payload"}."""

    def __init__(self, root: str | os.PathLike | None = None, max_entries: int = MAX_ENTRIES):
        self.root = Path(root) if root is not None else default_dir()
        self.dir = self.root / "plans"
        self.max_entries = max_entries

    def _path(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def get(self, name: str, kind: str) -> dict | None:
        """The payload stored under `name` for `kind`; None where there is none or it is unreadable
        (which warns: the caller plans again and put() replaces it)."""
        path = self._path(name)
        try:
            text = path.read_text()
        except OSError:
            return None
        try:
            entry = json.loads(text)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT or not isinstance(entry.get("payload"), dict):
                raise ValueError("not an entry of this version of graphopt")
        except ValueError as e:
            warn(f"graphopt's plan cache entry {path} is unreadable ({e}); planning again, and it will be "
                 "rewritten.", GraphoptWarning)
            return None
        if entry.get("kind") != kind:
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: the bound drops others first
        return entry["payload"]

    def put(self, name: str, kind: str, payload: dict) -> None:
        """Write the entry atomically, then keep at most max_entries. A cache that cannot be
        written (read-only, full disk) is skipped: the plan is made and used either way."""
        text = json.dumps({"format": FORMAT, "kind": kind, "payload": payload}, sort_keys=True)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".writing-", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self._path(name))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            warn(f"graphopt could not write its plan cache in {self.dir} ({e}); the plan is used but not kept.",
                 GraphoptWarning)
            return
        self._bound()

    def _bound(self) -> None:
        entries = []
        for path in self.dir.glob("*.json"):
            with contextlib.suppress(OSError):
                entries.append((path.stat().st_mtime, path))
        entries.sort()
        for _, path in entries[:max(len(entries) - self.max_entries, 0)]:
            with contextlib.suppress(OSError):
                path.unlink()
                path.with_suffix(".lock").unlink()

    @contextlib.contextmanager
    def planning(self, name: str):
        """Held while the plan for `name` is made: another process asking for it waits here, then
        finds the entry. No lock where the platform has no flock or the directory is not writable."""
        try:
            import fcntl
        except ImportError:  # Windows: each process plans
            yield
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            handle = open(self.dir / f"{name}.lock", "a")
        except OSError:
            yield
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def clear(self) -> int:
        """Drop every entry; returns how many there were."""
        count = 0
        for path in list(self.dir.glob("*.json")) + list(self.dir.glob("*.lock")):
            with contextlib.suppress(OSError):
                path.unlink()
                count += path.suffix == ".json"
        return count

    def __len__(self) -> int:
        return sum(1 for _ in self.dir.glob("*.json")) if self.dir.is_dir() else 0
