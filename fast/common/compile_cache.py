"""Compile cache for CuTe DSL kernels, keyed explicitly.

A kernel is compiled once per *static* configuration: dtypes, head dims, feature flags that
change the generated code, tile config and target arch. Sequence lengths, batch, head counts,
window sizes and the softmax scale are runtime arguments and never part of the key, so new
shapes do not recompile. The key is built by the kernel class (``compile_key()``), not hashed
from whatever arguments happen to be passed, so what triggers a recompile is written down.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Dict, Hashable, Optional


class CompileCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: Dict[Hashable, object] = {}
        self.compiles = 0  # number of real compilations, for tests that check reuse

    def get(self, key: Hashable, build: Callable[[], object]) -> object:
        with self._lock:
            hit = self._store.get(key)
        if hit is not None:
            return hit
        fn = build()  # compile outside the lock: it takes seconds, other keys may proceed
        with self._lock:
            if key not in self._store:
                self._store[key] = fn
                self.compiles += 1
            return self._store[key]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._store

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
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
