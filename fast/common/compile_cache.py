"""Compile cache for CuTe DSL kernels, keyed explicitly, in memory and on disk.

A kernel is compiled once per *static* configuration: dtypes, head dims, feature flags that
change the generated code, tile config and target arch. Sequence lengths, batch, head counts,
window sizes and the softmax scale are runtime arguments and never part of the key, so new
shapes do not recompile. The key is built by the kernel class (``compile_key()``), not hashed
from whatever arguments happen to be passed, so what triggers a recompile is written down.

On disk (between processes): a compiled function is written as the DSL's AOT object file
(``JitCompiledFunction.dump_to_object``: the host launch code with the cubin embedded) and a
later process loads it with ``cute.runtime.load_module`` instead of tracing and compiling again
(seconds -> milliseconds). Where:

* ``$DUALATTN_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/dualattn`` (default ``~/.cache/dualattn``);
  ``DUALATTN_CACHE_DIR=off`` (or ``0``/``none``/``false``/``disabled``) keeps the cache in memory only.
* One subdirectory per *fingerprint*: entry format, DSL version, python version, platform, the
  ``CUTE_DSL_*`` settings and a hash of every kernel source file (all ``*.py`` under ``fast/``);
  an edited kernel or another DSL gets a fresh folder, so a stale binary is never loaded. Old
  folders can be deleted freely.
* File name: the key's readable tag (kernel name and arch) plus a hash of ``repr(key)``. Keys
  must have a stable repr (tuples of str/int/bool/float/None/dataclasses); a key whose repr holds
  an object address (``at 0x``) is kept in memory only.
* An entry is ``MAGIC + sha256(payload) + payload``; a file whose checksum does not match, or that
  the DSL cannot load, is recompiled and overwritten, never trusted and never fatal.
* An entry is code that will run in this process, and a checksum proves integrity, not who wrote
  it: folders are created ``0700``, and an entry is read only when the entry, its fingerprint
  folder and the cache folder belong to this user and no one else may write them (POSIX). A
  cache folder that fails this (a shared or world-writable ``DUALATTN_CACHE_DIR``) is not used:
  kernels compile and stay in memory, with one warning.
* Writes go to a private temporary file in the same folder, then ``os.replace``: concurrent
  processes (pytest-xdist workers) see either no file or a whole one. Two processes that miss at
  once both compile and both write identical entries; the last rename wins.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Dict, Hashable, Optional

log = logging.getLogger("dualattn.compile_cache")

# bump when the entry layout or what goes into the fingerprint changes
_FORMAT = b"DUALATTN-CUTE-OBJ-1\n"
_EXPORT_PREFIX = "dualattn_kernel"  # symbol prefix inside every object file (one function each)
_OFF = {"off", "0", "none", "false", "disabled", "no"}
_FAST_ROOT = Path(__file__).resolve().parents[1]  # the fast/ package: every kernel's sources


def cache_dir() -> Optional[Path]:
    """The on-disk cache folder, or None when disabled (read at each miss, so tests may set it)."""
    env = os.environ.get("DUALATTN_CACHE_DIR", "").strip()
    if env.lower() in _OFF:
        return None
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dualattn"


_fingerprints: Dict[tuple, str] = {}


def source_fingerprint(roots=(_FAST_ROOT,)) -> str:
    """Hash of the DSL version, python, platform and every ``*.py`` under ``roots`` (names and
    contents). Computed once per process per roots: editing a kernel needs a new process anyway."""
    roots = tuple(Path(r) for r in roots)
    hit = _fingerprints.get(roots)
    if hit is not None:
        return hit
    h = hashlib.sha256(_FORMAT)
    h.update(f"dsl={_dsl_version()};py={sys.version_info[:2]};{sys.platform}".encode())
    # DSL switches that can change the generated code (line info, opt level, ...); the target
    # arch is in every key already and logging does not touch the code
    for name, value in sorted(os.environ.items()):
        if name.startswith("CUTE_DSL_") and name != "CUTE_DSL_ARCH" and "LOG" not in name:
            h.update(f"{name}={value};".encode())
    for root in roots:
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for f in files:
            data = f.read_bytes()
            h.update(f"{f.relative_to(root.parent).as_posix()}:{len(data)}:".encode())
            h.update(data)
    fp = h.hexdigest()[:20]
    _fingerprints[roots] = fp
    return fp


def _dsl_version() -> str:
    try:
        from importlib.metadata import version
        v = version("nvidia-cutlass-dsl")
    except Exception:  # the .cute bundle on the GPU machine has no dist-info
        import cutlass
        v = getattr(cutlass, "__version__", "unknown")
    # the DSL ships per-CUDA-major runtime libraries (cu12/cu13): part of what the object links to
    import cutlass
    libdir = "cu13" if "cu13" in str(Path(cutlass.__file__).resolve()) else "cu12"
    return f"{v}-{libdir}"


_runtime_loaded = False


def _load_runtime_global() -> None:
    """Load the DSL runtime libraries with RTLD_GLOBAL once: dumping and loading object files
    resolves CUDA runtime symbols (cudaLibraryLoadData, ...) through them, and the DSL itself
    opens them without RTLD_GLOBAL ("JIT session error: Symbols not found")."""
    global _runtime_loaded
    if _runtime_loaded:
        return
    import ctypes
    import cutlass.cute as cute
    for path in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(path).exists():
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _runtime_loaded = True


def _key_tag(key) -> str:
    """Readable part of a file name: the first and last elements of the key (kernel, arch)."""
    parts = [key[0], key[-1]] if isinstance(key, tuple) and key else [type(key).__name__]
    s = "-".join(str(p) for p in parts)
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in s)[:48]


def untrusted_reason(path: Path) -> Optional[str]:
    """Why ``path`` (an existing file or folder) must not be trusted for code, or None: not
    owned by this user, or writable by group or others. Always None where there are no uids."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:  # not POSIX: no ownership model to check
        return None
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None  # nothing there yet: nothing to distrust (a failed write reports itself)
    if st.st_uid != getuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user ({getuid()})"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {st.st_mode & 0o777:o})"
    return None


def _make_private_dirs(folder: Path, root: Path) -> None:
    """mkdir -p with mode 0700 for every folder created from ``root`` down to ``folder``."""
    for d in reversed([folder, *folder.parents]):
        if d == root or root in d.parents:
            if not d.exists():
                d.mkdir(mode=0o700, exist_ok=True)


class CompileCache:
    """``get(key, build)``: the compiled function for ``key``, from memory, else from disk, else
    ``build()`` (then stored in both). ``build`` returns a ``cute.compile`` result; anything
    without ``dump_to_object`` is cached in memory only.

    Counters for tests and logs: ``compiles`` (``build()`` calls that produced the stored entry),
    ``loads`` (entries read from disk), ``stores`` (entries written), ``disk_errors`` (unusable
    files met and replaced, or failed writes)."""

    def __init__(self, sources=None) -> None:
        self._lock = threading.Lock()
        self._store: Dict[Hashable, object] = {}
        self._sources = tuple(sources) if sources else (_FAST_ROOT,)
        self.compiles = 0  # number of real compilations, for tests that check reuse
        self.loads = 0
        self.stores = 0
        self.disk_errors = 0
        self._distrusted: Dict[Path, str] = {}  # cache roots refused, with the reason (warned once)

    def get(self, key: Hashable, build: Callable[[], object]) -> object:
        hit = self._store.get(key)  # a dict read is atomic: no lock on the hot path
        if hit is not None:
            return hit
        path = self.path_for(key)
        fn = self._load(path) if path is not None else None
        loaded = fn is not None
        if fn is None:
            fn = build()  # compile outside the lock: it takes seconds, other keys may proceed
        with self._lock:
            if key in self._store:
                return self._store[key]
            self._store[key] = fn
            if loaded:
                self.loads += 1
            else:
                self.compiles += 1
        if not loaded and path is not None:
            self._save(path, fn)
        return fn

    # -- disk ----------------------------------------------------------------------------------
    def path_for(self, key: Hashable) -> Optional[Path]:
        """The entry file of ``key``; None when the disk cache is off or the key has no stable repr."""
        root = cache_dir()
        if root is None:
            return None
        r = repr(key)
        if " at 0x" in r:  # default object repr: differs per process, would never hit
            return None
        digest = hashlib.sha256(r.encode()).hexdigest()[:32]
        path = root / source_fingerprint(self._sources) / f"{_key_tag(key)}-{digest}.o"
        reason = self._distrust(root, path)
        if reason is not None:
            if root not in self._distrusted:
                self._distrusted[root] = reason
                self.disk_errors += 1
                log.warning("compile cache: not using %s on disk (%s); kernels stay in memory", root, reason)
            return None
        return path

    @staticmethod
    def _distrust(root: Path, path: Path) -> Optional[str]:
        for p in (root, path.parent, path):
            reason = untrusted_reason(p)
            if reason is not None:
                return reason
        return None

    def _load(self, path: Path):
        try:
            blob = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # a plain miss
            return None
        except OSError as e:
            log.warning("compile cache: cannot read %s (%s); recompiling", path, e)
            self.disk_errors += 1
            return None
        head = len(_FORMAT) + 32
        if (len(blob) <= head or blob[:len(_FORMAT)] != _FORMAT
                or hashlib.sha256(blob[head:]).digest() != blob[len(_FORMAT):head]):
            # truncated, foreign or bit-flipped: never hand it to the linker
            log.warning("compile cache: %s is corrupt; recompiling and overwriting", path)
            self.disk_errors += 1
            return None
        try:
            _load_runtime_global()
            import cutlass.cute as cute
            # load_module reads a path: give it the verified payload through a private file
            with tempfile.NamedTemporaryFile(prefix="dualattn-", suffix=".o") as tmp:
                tmp.write(blob[head:])
                tmp.flush()
                fn = cute.runtime.load_module(tmp.name)[_EXPORT_PREFIX]
        except Exception as e:  # the DSL could not load it (ABI drift, foreign object)
            log.warning("compile cache: cannot load %s (%s: %s); recompiling and overwriting",
                        path, type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else "")
            self.disk_errors += 1
            return None
        log.debug("compile cache: loaded %s", path)
        return fn

    def _save(self, path: Path, fn) -> None:
        dump = getattr(fn, "dump_to_object", None)
        if dump is None:
            return
        tmp = None
        try:
            _load_runtime_global()
            payload = dump(_EXPORT_PREFIX)
            root = path.parent.parent
            root.parent.mkdir(parents=True, exist_ok=True)  # e.g. ~/.cache: not ours to restrict
            _make_private_dirs(path.parent, root)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(_FORMAT + hashlib.sha256(payload).digest() + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see no file or the whole file
            tmp = None
            self.stores += 1
            log.debug("compile cache: stored %s", path)
        except Exception as e:  # a read-only or full disk must not fail the call
            self.disk_errors += 1
            log.warning("compile cache: cannot write %s (%s: %s)", path, type(e).__name__, e)
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    # -- memory --------------------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._store

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        """Forget the in-memory entries (the disk entries stay; delete cache_dir() to drop them)."""
        with self._lock:
            self._store.clear()


def arch_string(arch: int) -> str:
    """CuTe DSL target for a compute capability int (90 -> 'sm_90a', 120 -> 'sm_120a', 80 -> 'sm_80')."""
    if arch >= 90:
        return f"sm_{arch}a"
    return f"sm_{arch}"


def target_arch(device_arch: Optional[int]) -> int:
    """The arch to compile for: CUTE_DSL_ARCH if set (cross-compiling), else the device's."""
    env = os.environ.get("CUTE_DSL_ARCH", "")
    if env.startswith("sm_"):
        return int("".join(ch for ch in env[3:] if ch.isdigit()))
    if device_arch is None:
        raise RuntimeError("no CUDA device and CUTE_DSL_ARCH unset: cannot pick a target arch")
    return device_arch
