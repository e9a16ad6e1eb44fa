"""The compile cache (fast/common/compile_cache.py): in memory, on disk between processes.

CPU only: a real sm_90a kernel is cross-compiled and stored by one process and loaded by fresh
ones without recompiling (checked through the cache's counters); corrupt, undecodable and stale
(edited source) entries are recompiled and overwritten. The rest uses stand-in build results.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dualattn.fast.common import compile_cache as cc
from dualattn.fast.common.compile_cache import CompileCache

pytestmark = pytest.mark.filterwarnings("ignore")


class _Dumpable:
    """A build result that can be written (its bytes are not an object file: loading fails)."""

    def __init__(self, tag):
        self.tag = tag

    def dump_to_object(self, prefix):
        return b"not an ELF object " + self.tag.encode()


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DUALATTN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_memory_hit_builds_once(cache_env):
    c, calls = CompileCache(), []
    build = lambda: calls.append(1) or object()  # noqa: E731
    a = c.get(("k", 1), build)
    assert c.get(("k", 1), build) is a and len(calls) == 1 and c.compiles == 1
    c.get(("k", 2), build)
    assert len(calls) == 2 and len(c) == 2 and ("k", 2) in c
    assert not cache_env.exists()  # objects without dump_to_object stay in memory


@pytest.mark.parametrize("value", ["off", "OFF", "0", "none", "false", "disabled"])
def test_disabled_by_env(monkeypatch, value):
    monkeypatch.setenv("DUALATTN_CACHE_DIR", value)
    assert cc.cache_dir() is None
    c = CompileCache()
    assert c.path_for(("k", "sm_90a")) is None
    c.get(("k", "sm_90a"), lambda: _Dumpable("x"))
    assert c.compiles == 1 and c.stores == 0


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("DUALATTN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cc.cache_dir() == tmp_path / "xdg" / "dualattn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cc.cache_dir() == tmp_path / "home" / ".cache" / "dualattn"
    monkeypatch.setenv("DUALATTN_CACHE_DIR", str(tmp_path / "mine"))
    assert cc.cache_dir() == tmp_path / "mine"


def test_file_name_from_key_and_fingerprint(cache_env, tmp_path):
    c = CompileCache()
    p1 = c.path_for(("sm90_fwd", "torch.bfloat16", 128, True, "sm_90a"))
    p2 = c.path_for(("sm90_fwd", "torch.bfloat16", 128, False, "sm_90a"))
    assert p1 != p2 and p1.parent == p2.parent and p1.parent.parent == cache_env
    assert p1.name.startswith("sm90_fwd-sm_90a-")
    assert p1 == CompileCache().path_for(("sm90_fwd", "torch.bfloat16", 128, True, "sm_90a"))
    # a key whose repr holds an object address would never hit in another process
    assert c.path_for(("k", object())) is None
    # the fingerprint covers the kernel sources: an edit moves every entry
    src = tmp_path / "src"
    src.mkdir()
    (src / "kern.py").write_text("A = 1\n")
    before = CompileCache(sources=[src]).path_for(("k", 1))
    cc._fingerprints.clear()
    (src / "kern.py").write_text("A = 2\n")
    after = CompileCache(sources=[src]).path_for(("k", 1))
    cc._fingerprints.clear()
    assert before.name == after.name and before.parent != after.parent


def test_corrupt_or_unloadable_entry_is_rebuilt(cache_env):
    key = ("fake", "sm_90a")
    c = CompileCache()
    c.get(key, lambda: _Dumpable("a"))
    path = c.path_for(key)
    assert c.stores == 1 and path.is_file()
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # no leftovers
    # valid checksum, payload the DSL cannot load: rebuilt and overwritten, no exception
    c2 = CompileCache()
    c2.get(key, lambda: _Dumpable("b"))
    assert (c2.loads, c2.compiles, c2.disk_errors, c2.stores) == (0, 1, 1, 1)
    assert path.read_bytes().endswith(b"b")
    # truncated and bit-flipped files are refused before they reach the DSL
    blob = path.read_bytes()
    for bad in (blob[: len(blob) // 2], blob[:-1] + b"X", b"", b"garbage"):
        path.write_bytes(bad)
        c3 = CompileCache()
        c3.get(key, lambda: _Dumpable("c"))
        assert (c3.loads, c3.compiles, c3.disk_errors) == (0, 1, 1)
        assert path.read_bytes() != bad


def test_unwritable_dir_does_not_fail(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("DUALATTN_CACHE_DIR", str(blocker / "sub"))  # mkdir under a file fails
    c = CompileCache()
    fn = c.get(("k", 1), lambda: _Dumpable("a"))
    assert isinstance(fn, _Dumpable) and c.compiles == 1 and c.stores == 0 and c.disk_errors == 1


# -- a real kernel across processes ------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import json, sys, time
    import torch
    from dualattn.spec import AttentionSpec
    from dualattn.fast.sm90 import FastSm90Forward
    from dualattn.fast.common.compile_cache import CompileCache
    spec = AttentionSpec("batched", 1, 64, 64, 2, 2, 64, 64, torch.float16, "cuda", causal=True)
    impl = FastSm90Forward()
    sources = sys.argv[1:] or None
    cache = CompileCache(sources=sources)
    key = impl.compile_key(spec, 90)
    t0 = time.perf_counter()
    fn = cache.get(key, lambda: impl.compile_for(spec, 90))
    dt = time.perf_counter() - t0
    print(json.dumps(dict(compiles=cache.compiles, loads=cache.loads, stores=cache.stores,
                          errors=cache.disk_errors, seconds=dt, path=str(cache.path_for(key)),
                          sig=str(fn.execution_args.signature))))
""")


def _child(cache_dir, *sources):
    env = dict(os.environ, DUALATTN_CACHE_DIR=str(cache_dir))
    r = subprocess.run([sys.executable, "-c", _CHILD, *map(str, sources)], env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.compile_only
def test_sm90_kernel_persists_across_processes(tmp_path):
    pytest.importorskip("cutlass")
    cache_dir = tmp_path / "cache"
    first = _child(cache_dir)
    assert (first["compiles"], first["loads"], first["stores"], first["errors"]) == (1, 0, 1, 0)
    path = Path(first["path"])
    assert path.is_file()

    second = _child(cache_dir)  # a fresh process: loaded, not compiled
    assert (second["compiles"], second["loads"], second["errors"]) == (0, 1, 0)
    assert second["sig"] == first["sig"] and second["path"] == first["path"]

    blob = path.read_bytes()
    path.write_bytes(blob[:-100] + bytes(100))  # corrupt the object's tail
    third = _child(cache_dir)
    assert (third["compiles"], third["loads"], third["stores"], third["errors"]) == (1, 0, 1, 1)
    assert path.read_bytes() == blob  # overwritten with a good entry (compilation is deterministic)

    # stale sources: an edited kernel file gives another fingerprint, so it compiles again
    src = tmp_path / "src"
    src.mkdir()
    (src / "kernel.py").write_text("VERSION = 1\n")
    a = _child(cache_dir, src)
    assert (a["compiles"], a["loads"]) == (1, 0)
    (src / "kernel.py").write_text("VERSION = 2\n")
    b = _child(cache_dir, src)
    assert (b["compiles"], b["loads"]) == (1, 0) and b["path"] != a["path"]


def test_dsl_settings_are_part_of_the_fingerprint(cache_env, monkeypatch):
    key = ("k", "sm_90a")
    cc._fingerprints.clear()
    base = CompileCache().path_for(key)
    cc._fingerprints.clear()
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    assert CompileCache().path_for(key).parent != base.parent
    cc._fingerprints.clear()
    monkeypatch.delenv("CUTE_DSL_LINEINFO")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_120a")  # in the key already, not in the folder
    assert CompileCache().path_for(key) == base
    cc._fingerprints.clear()


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX ownership and modes")
def test_folders_are_private_and_shared_ones_are_not_trusted(cache_env):
    key = ("fake", "sm_90a")
    c = CompileCache()
    c.get(key, lambda: _Dumpable("a"))
    path = c.path_for(key)
    for d in (cache_env, path.parent):
        assert d.stat().st_mode & 0o777 == 0o700
    # anyone may write the cache folder (a shared DUALATTN_CACHE_DIR): an entry there could be
    # anybody's code, checksum or not, so the disk is not used at all, and the call still works
    for loose, mode in ((cache_env, 0o777), (path.parent, 0o770), (path, 0o666)):
        loose.chmod(mode)
        c2 = CompileCache()
        fn = c2.get(key, lambda: _Dumpable("b"))
        assert isinstance(fn, _Dumpable) and fn.tag == "b"
        assert (c2.loads, c2.compiles, c2.stores, c2.disk_errors) == (0, 1, 0, 1)
        if loose.is_dir():  # a loose folder taints every entry in it; a loose file only itself
            assert c2.path_for(("other", "sm_90a")) is None and c2.disk_errors == 1  # warned once
        assert "writable by group or others" in next(iter(c2._distrusted.values()))
        loose.chmod(0o700 if loose.is_dir() else 0o600)
    # another user's folder
    if os.getuid() == 0:
        os.chown(path.parent, 12345, -1)
        assert "belongs to uid 12345" in cc.untrusted_reason(path.parent)
        assert CompileCache().path_for(key) is None
