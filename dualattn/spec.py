"""The one validated description of an attention call.

Every public entry point builds an :class:`AttentionCall` through :func:`build_dense`,
:func:`build_varlen` or :func:`build_kvcache`. Those functions are the only place that checks
user input; implementations receive the call and trust it.

``AttentionCall.spec`` (an :class:`AttentionSpec`) is the static, hashable part: shapes that
matter for code generation, dtypes, flags. ``AttentionCall`` also carries the tensors.
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Tuple

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 8, 256, 8

# Value checks (monotone cu_seqlens, CSR order, page-table range ...) read device memory and
# therefore synchronise. They run unless a CUDA graph is being captured, or the user opted out.
_VALUE_CHECKS = os.environ.get("DUALATTN_VALUE_CHECKS", "1") != "0"


def set_value_checks(enabled: bool) -> None:
    """Turn the data-dependent input checks (which synchronise with the GPU) on or off."""
    global _VALUE_CHECKS
    _VALUE_CHECKS = bool(enabled)


def version_counters(tensors):
    """The tensors' version counters (in-place changes through torch move them); None where one
    has none (tensors made under torch.inference_mode count no in-place changes)."""
    if any(t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


class ValueCheckMemo:
    """Tensors whose values passed a check, remembered by identity (a weak reference: the memo
    keeps nothing alive) and version counter together with what else the check read. A tensor
    reused across calls (the same cu_seqlens, key ranges or CSR in every layer) is read back,
    which synchronises, once; a new tensor, or one changed in place through torch since, is
    checked again. Writes that bypass torch (a raw-pointer kernel) do not move the counter, and
    tensors made under torch.inference_mode have none: those are checked on every call."""

    def __init__(self, capacity: int = 256):
        self._seen: dict = {}
        self._values: dict = {}
        self._capacity = capacity

    def passed(self, what: tuple, *tensors) -> bool:
        hit = self._seen.get((what, tuple(id(t) for t in tensors)))
        return (hit is not None and all(r() is t for r, t in zip(hit[0], tensors))
                and hit[1] == version_counters(tensors))

    def remember(self, what: tuple, *tensors) -> None:
        versions = version_counters(tensors)
        if versions is None:
            return
        if len(self._seen) >= self._capacity:
            self._seen.clear()
        self._seen[(what, tuple(id(t) for t in tensors))] = (tuple(weakref.ref(t) for t in tensors), versions)

    def remember_values(self, tensor, values: tuple) -> None:
        """Keep the host copy of a small tensor the checks read back (cu_seqlens), under the same
        identity and version rule, for launches that plan by it (FastSm90Forward.varlen_unit_table)
        without reading device memory again. Tensors made under torch.inference_mode have no
        version counter: they are checked, and their copy taken again, on every call."""
        versions = version_counters((tensor,))
        if len(self._values) >= self._capacity:
            self._values.clear()
        self._values[id(tensor)] = (weakref.ref(tensor), versions, values)

    def host_values(self, tensor):
        """The values remember_values kept for ``tensor``, or None (not read, or changed since)."""
        hit = self._values.get(id(tensor))
        if hit is None or hit[0]() is not tensor or hit[1] != version_counters((tensor,)):
            return None
        return hit[2]


VALUE_CHECK_MEMO = ValueCheckMemo()


def value_checks_enabled() -> bool:
    if not _VALUE_CHECKS:
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    try:  # inside torch.compile tracing, tensors have no values to read
        if torch.compiler.is_compiling():
            return False
    except AttributeError:  # pragma: no cover - old torch
        pass
    return True


@dataclass(frozen=True)
class AttentionSpec:
    """Static description of a call: everything a kernel specialises on, nothing data-dependent."""

    mode: str  # "batched" | "varlen" | "kvcache"
    batch: int
    seqlen_q: int  # Sq, or max_seqlen_q for varlen, or new query tokens for kvcache
    seqlen_k: int  # Sk, or max_seqlen_k for varlen, or max visible keys for kvcache
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    device_type: str
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    scale: float = 1.0
    num_key_ranges: int = 0  # R of key_ranges, 0 when absent
    block_size: Optional[Tuple[int, int]] = None  # (block_m, block_n) of the BlockSparse, if any
    deterministic: bool = False
    return_lse: bool = False
    # kv-cache only
    paged: bool = False
    page_size: int = 0
    num_new_kv: int = 0
    num_splits: int = 0
    # autograd will ask for dQ, dK, dV (set by the public API from requires_grad)
    needs_grad: bool = False
    # key_ranges or a CSR column array holds 2**31 elements or more: kernels that index them with
    # 32-bit offsets refuse (the shape of these tensors is otherwise not part of the spec)
    wide_index_tensors: bool = False

    def __hash__(self) -> int:
        # a spec keys several per-call lookups (dispatch, kernel entries): hash its fields once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple([getattr(self, n) for n in _SPEC_FIELDS]))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self):
        # str hashes differ between processes: never carry the cached one along
        return {n: v for n, v in self.__dict__.items() if n != "_hash"}

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads_q // self.num_heads_kv

    @property
    def has_window(self) -> bool:
        return self.window != (-1, -1)

    @property
    def has_key_ranges(self) -> bool:
        return self.num_key_ranges > 0

    @property
    def has_block_sparse(self) -> bool:
        return self.block_size is not None

    @property
    def has_element_mask(self) -> bool:
        return self.causal or self.has_window or self.has_key_ranges

    def features(self) -> frozenset:
        """Names of what this call needs; implementations refuse by feature name."""
        f = {self.mode, f"dtype:{str(self.dtype).replace('torch.', '')}"}
        if self.num_heads_q != self.num_heads_kv:
            f.add("gqa")
        if self.causal:
            f.add("causal")
        if self.has_window:
            f.add("window")
        if self.softcap > 0:
            f.add("softcap")
        if self.has_key_ranges:
            f.add("key_ranges")
        if self.has_block_sparse:
            f.add("block_sparse")
        if self.deterministic:
            f.add("deterministic")
        if self.head_dim != self.head_dim_v:
            f.add("dv_ne_d")
        if self.paged:
            f.add("paged")
        if self.num_new_kv:
            f.add("append_kv")
        if self.needs_grad:
            f.add("backward")
        return frozenset(f)

    def short(self) -> str:
        parts = [f"{self.mode} b{self.batch} sq{self.seqlen_q} sk{self.seqlen_k}",
                 f"h{self.num_heads_q}/{self.num_heads_kv} d{self.head_dim}"
                 + (f"/{self.head_dim_v}" if self.head_dim_v != self.head_dim else ""),
                 str(self.dtype).replace("torch.", "")]
        parts += sorted(x for x in self.features() if ":" not in x and x != self.mode)
        return " ".join(parts)


_SPEC_FIELDS = tuple(f.name for f in fields(AttentionSpec))


@dataclass
class AttentionCall:
    """A validated call: the static spec plus its tensors."""

    spec: AttentionSpec
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    key_ranges: Optional[torch.Tensor] = None
    block_sparse: Optional[object] = None  # dualattn.sparse.BlockSparse
    cache_seqlens: Optional[torch.Tensor] = None
    page_table: Optional[torch.Tensor] = None
    k_new: Optional[torch.Tensor] = None
    v_new: Optional[torch.Tensor] = None
    extra: dict = field(default_factory=dict)

    def with_tensors(self, **kw) -> "AttentionCall":
        return replace(self, **kw)


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------

def _err(arg: str, rule: str) -> ValueError:
    return ValueError(f"{arg}: {rule}")


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise _err(name, f"expected {ndim} dimensions, got shape {tuple(t.shape)}")


def _check_qkv_dtypes_devices(q, k, v, names=("q", "k", "v")) -> None:
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{names[0]}: dtype {q.dtype} not supported; use one of float16, bfloat16, float32")
    for name, t in zip(names[1:], (k, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from {names[0]}'s dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on device {t.device}, but {names[0]} is on {q.device}")


def _check_head_dim(name: str, d: int) -> None:
    if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM and d % HEAD_DIM_MULTIPLE == 0):
        raise _err(name, f"head dim {d} not supported; must be a multiple of {HEAD_DIM_MULTIPLE} "
                         f"in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")


def _check_heads(hq: int, hkv: int) -> None:
    if hkv <= 0 or hq % hkv != 0:
        raise _err("k", f"number of query heads ({hq}) must be a multiple of the number of key/value heads ({hkv})")


def _check_scalars(causal, window, softcap, scale, head_dim):
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected bool, got {type(causal).__name__}")
    if window is None:
        window = (-1, -1)
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise TypeError("window: expected a pair (left, right)")
    w = []
    for x in window:
        if x is None:
            x = -1
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"window: entries must be int, got {window!r}")
        if x < -1:
            raise _err("window", f"entries must be -1 (unbounded) or >= 0, got {tuple(window)}")
        w.append(int(x))
    softcap = float(softcap or 0.0)
    if not math.isfinite(softcap) or softcap < 0:
        raise _err("softcap", f"must be >= 0 (0 disables it), got {softcap}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise _err("scale", f"must be a positive finite number, got {scale}")
    return tuple(w), softcap, scale


def _clamp_window(window, seqlen_q: int, seqlen_k: int):
    """Window bounds past ``seqlen_q + seqlen_k`` mean the same as that value (a left bound >= Sk
    or a right bound >= Sq already reaches every key), so they are clamped there: kernels add
    the bounds to row and key indices in 32-bit arithmetic, where ``window=(-1, 2**31 - 1)`` wrapped
    to "no key visible" and made the deterministic backward's lock ranks disagree with the
    visiting blocks (a hang)."""
    reach = int(seqlen_q) + int(seqlen_k)
    return tuple(x if x < 0 else min(x, reach) for x in window)


def _wide_index_tensors(key_ranges, block_sparse) -> bool:
    big = 2 ** 31
    if key_ranges is not None and key_ranges.numel() >= big:
        return True
    if block_sparse is not None:
        return any(t.numel() >= big for t in (block_sparse.q2k_full.col, block_sparse.q2k_mask.col))
    return False


def _check_cu_seqlens(name: str, cu, batch_plus_1: Optional[int], total: int, max_seqlen: int,
                      max_name: str, device) -> int:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}: must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise _err(name, f"must be 1-D of length batch+1 >= 2, got shape {tuple(cu.shape)}")
    if batch_plus_1 is not None and cu.numel() != batch_plus_1:
        raise _err(name, f"length {cu.numel()} differs from the other cu_seqlens' length {batch_plus_1}")
    if cu.device != device:
        raise ValueError(f"{name}: on device {cu.device}, but q is on {device}")
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise TypeError(f"{max_name}: expected a non-negative int, got {max_seqlen!r}")
    what = ("cu_seqlens", total, max_seqlen)  # what the checks read besides the values
    if value_checks_enabled() and not VALUE_CHECK_MEMO.passed(what, cu):
        c = cu.cpu()
        if int(c[0]) != 0:
            raise _err(name, f"must start at 0, got {int(c[0])}")
        d = c[1:] - c[:-1]
        if bool((d < 0).any()):
            raise _err(name, "must be non-decreasing (monotone)")
        if int(c[-1]) != total:
            raise _err(name, f"last entry {int(c[-1])} must equal the number of packed tokens {total}")
        if int(d.max()) > max_seqlen:
            raise _err(max_name, f"{max_seqlen} is smaller than the longest sequence {int(d.max())}")
        VALUE_CHECK_MEMO.remember(what, cu)
        VALUE_CHECK_MEMO.remember_values(cu, tuple(c.tolist()))
    return cu.numel() - 1


def _check_key_ranges(kr, batch: int, hq: int, sq_total: int, sk: int, varlen: bool, device):
    if kr is None:
        return 0
    _check_tensor("key_ranges", kr, 5)
    if kr.dtype != torch.int32:
        raise TypeError(f"key_ranges: must be int32, got {kr.dtype}")
    if kr.device != device:
        raise ValueError(f"key_ranges: on device {kr.device}, but q is on {device}")
    b, h, s, r, two = kr.shape
    want_b = (1,) if varlen else (1, batch)
    if b not in want_b or h not in (1, hq) or s != sq_total or two != 2 or r < 1:
        lead = "1" if varlen else "B or 1"
        raise _err("key_ranges", f"expected shape ({lead}, Hq or 1, {sq_total}, R>=1, 2), got {tuple(kr.shape)}")
    if value_checks_enabled() and kr.numel() and not VALUE_CHECK_MEMO.passed(("key_ranges", sk), kr):
        lo, hi = kr[..., 0], kr[..., 1]
        if bool((lo > hi).any()):
            raise _err("key_ranges", "every interval needs lo <= hi")
        if bool((lo < 0).any()) or bool((hi > sk).any()):
            raise _err("key_ranges", f"interval ends must lie in [0, Sk={sk}]")
        VALUE_CHECK_MEMO.remember(("key_ranges", sk), kr)
    return r


def _check_block_sparse(bs, batch: int, hq: int, sq: int, sk: int, device, exact_lengths: bool):
    if bs is None:
        return None
    from .sparse import BlockSparse

    if not isinstance(bs, BlockSparse):
        raise TypeError(f"block_sparse: expected dualattn.BlockSparse, got {type(bs).__name__}")
    if bs.device != device:
        raise ValueError(f"block_sparse: on device {bs.device}, but q is on {device} (use .to(device))")
    bs.check_compatible(batch, hq, sq, sk, validate_values=value_checks_enabled(), exact_lengths=exact_lengths)
    return (bs.block_m, bs.block_n)


# --------------------------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------------------------

# Specs of dense calls already validated, keyed by everything the checks read (shapes, dtypes,
# devices, the scalar arguments and their types): the checks are a pure function of these, so a
# repeated call skips them and reuses the spec (host overhead of a cached kernel call). Calls
# with key_ranges / block_sparse carry values to check and always take the full path.
_DENSE_MEMO: dict = {}
_PLAIN_SCALARS = (float, int, type(None))
_DENSE_MEMO_MAX = 1024
_Tensor = torch.Tensor


def dense_memo_key(q, k, v, causal, window, softcap, scale, deterministic, return_lse, needs_grad):
    """What build_dense's checks of a call without key ranges or a CSR depend on (shapes, dtypes,
    devices, flags), as a hashable key; None where the arguments are not memoisable. Hashing it
    can still raise TypeError (an unhashable flag): the caller treats that as no key."""
    if (q.__class__ is _Tensor and k.__class__ is _Tensor and v.__class__ is _Tensor
            and window.__class__ is tuple and len(window) == 2
            # a 0-d tensor scale/softcap hashes by identity but may change in place: not memoised
            and scale.__class__ in _PLAIN_SCALARS and softcap.__class__ in _PLAIN_SCALARS):
        # the classes of causal and the window entries are in the key: True == 1 and 1 == 1.0 hash
        # alike, but the checks accept only bool / int there
        return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                causal.__class__, causal, window, window[0].__class__, window[1].__class__, softcap,
                scale, deterministic, return_lse, needs_grad)
    return None


def build_dense(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, scale=None, key_ranges=None,
                block_sparse=None, deterministic=False, return_lse=False, needs_grad=False) -> AttentionCall:
    memo_key = None
    if key_ranges is None and block_sparse is None:
        memo_key = dense_memo_key(q, k, v, causal, window, softcap, scale, deterministic, return_lse, needs_grad)
        try:
            spec = _DENSE_MEMO.get(memo_key) if memo_key is not None else None
        except TypeError:  # an unhashable argument: the full checks say what is wrong with it
            spec, memo_key = None, None
        if spec is not None:
            return AttentionCall(spec, q, k, v)
    for n, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(n, t, 4)
    _check_qkv_dtypes_devices(q, k, v)
    B, Sq, Hq, D = q.shape
    Bk, Sk, Hkv, Dk = k.shape
    if Bk != B:
        raise _err("k", f"batch {Bk} differs from q's batch {B}")
    if Dk != D:
        raise _err("k", f"head dim {Dk} differs from q's head dim {D}")
    if tuple(v.shape[:3]) != (B, Sk, Hkv):
        raise _err("v", f"shape {tuple(v.shape)} must match k's (B, Sk, Hkv) = {(B, Sk, Hkv)}")
    Dv = v.shape[3]
    _check_heads(Hq, Hkv)
    _check_head_dim("q", D)
    _check_head_dim("v", Dv)
    window, softcap, scale = _check_scalars(causal, window, softcap, scale, D)
    window = _clamp_window(window, Sq, Sk)
    r = _check_key_ranges(key_ranges, B, Hq, Sq, Sk, False, q.device)
    bsz = _check_block_sparse(block_sparse, B, Hq, Sq, Sk, q.device, True)
    spec = AttentionSpec("batched", B, Sq, Sk, Hq, Hkv, D, Dv, q.dtype, q.device.type, causal, window,
                         softcap, scale, r, bsz, bool(deterministic), bool(return_lse),
                         needs_grad=bool(needs_grad),
                         wide_index_tensors=_wide_index_tensors(key_ranges, block_sparse))
    if memo_key is not None:
        if len(_DENSE_MEMO) >= _DENSE_MEMO_MAX:  # keys hold shapes: keep it bounded
            _DENSE_MEMO.clear()
        _DENSE_MEMO[memo_key] = spec
    return AttentionCall(spec, q, k, v, key_ranges=key_ranges, block_sparse=block_sparse)


def build_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                 window=(-1, -1), softcap=0.0, scale=None, key_ranges=None, block_sparse=None,
                 deterministic=False, return_lse=False, needs_grad=False) -> AttentionCall:
    for n, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(n, t, 3)
    _check_qkv_dtypes_devices(q, k, v)
    Tq, Hq, D = q.shape
    Tk, Hkv, Dk = k.shape
    if Dk != D:
        raise _err("k", f"head dim {Dk} differs from q's head dim {D}")
    if tuple(v.shape[:2]) != (Tk, Hkv):
        raise _err("v", f"shape {tuple(v.shape)} must match k's (total_k, Hkv) = {(Tk, Hkv)}")
    Dv = v.shape[2]
    _check_heads(Hq, Hkv)
    _check_head_dim("q", D)
    _check_head_dim("v", Dv)
    window, softcap, scale = _check_scalars(causal, window, softcap, scale, D)
    B = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, Tq, max_seqlen_q, "max_seqlen_q", q.device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, B + 1, Tk, max_seqlen_k, "max_seqlen_k", q.device)
    # no sequence is longer than its packed tensor, whatever bound max_seqlen_* states
    window = _clamp_window(window, min(int(max_seqlen_q), Tq), min(int(max_seqlen_k), Tk))
    r = _check_key_ranges(key_ranges, B, Hq, Tq, max_seqlen_k, True, q.device)
    bsz = _check_block_sparse(block_sparse, B, Hq, max_seqlen_q, max_seqlen_k, q.device, False)
    spec = AttentionSpec("varlen", B, int(max_seqlen_q), int(max_seqlen_k), Hq, Hkv, D, Dv, q.dtype,
                         q.device.type, causal, window, softcap, scale, r, bsz, bool(deterministic),
                         bool(return_lse), needs_grad=bool(needs_grad),
                         wide_index_tensors=_wide_index_tensors(key_ranges, block_sparse))
    # the kernels read cu_seqlens[b], cu_seqlens[b + 1] with a unit stride (a strided view, e.g. a
    # column of a larger table, would read other memory)
    return AttentionCall(spec, q, k, v, cu_seqlens_q=cu_seqlens_q.contiguous(),
                         cu_seqlens_k=cu_seqlens_k.contiguous(), key_ranges=key_ranges, block_sparse=block_sparse)


def build_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table=None, k_new=None, v_new=None,
                  causal=False, window=(-1, -1), softcap=0.0, scale=None, num_splits=0,
                  return_lse=False) -> AttentionCall:
    _check_tensor("q", q, 4)
    _check_tensor("k_cache", k_cache, 4)
    _check_tensor("v_cache", v_cache, 4)
    _check_qkv_dtypes_devices(q, k_cache, v_cache, ("q", "k_cache", "v_cache"))
    B, Sq, Hq, D = q.shape
    Bc, cap, Hkv, Dk = k_cache.shape  # paged: (num_pages, page_size, Hkv, D)
    if Dk != D:
        raise _err("k_cache", f"head dim {Dk} differs from q's head dim {D}")
    if tuple(v_cache.shape[:3]) != (Bc, cap, Hkv):
        raise _err("v_cache", f"shape {tuple(v_cache.shape)} must match k_cache's first three dims {(Bc, cap, Hkv)}")
    Dv = v_cache.shape[3]
    _check_heads(Hq, Hkv)
    _check_head_dim("q", D)
    _check_head_dim("v_cache", Dv)
    window, softcap, scale = _check_scalars(causal, window, softcap, scale, D)
    if not isinstance(num_splits, int) or num_splits < 0:
        raise _err("num_splits", f"must be an int >= 0 (0 = choose automatically), got {num_splits!r}")
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected a torch.Tensor, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens: must be int32, got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (B,):
        raise _err("cache_seqlens", f"expected shape ({B},), got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens: on device {cache_seqlens.device}, but q is on {q.device}")
    paged = page_table is not None
    if paged:
        _check_tensor("page_table", page_table, 2)
        if page_table.dtype != torch.int32:
            raise TypeError(f"page_table: must be int32, got {page_table.dtype}")
        if page_table.shape[0] != B:
            raise _err("page_table", f"first dim {page_table.shape[0]} must equal the batch {B}")
        if page_table.device != q.device:
            raise ValueError(f"page_table: on device {page_table.device}, but q is on {q.device}")
        page_size = cap
        capacity = page_table.shape[1] * page_size
        num_pages = Bc
    else:
        if Bc != B:
            raise _err("k_cache", f"batch {Bc} differs from q's batch {B}")
        page_size, capacity, num_pages = 0, cap, 0
    n_new = 0
    if (k_new is None) != (v_new is None):
        raise _err("k_new", "k_new and v_new must be given together")
    if k_new is not None:
        _check_tensor("k_new", k_new, 4)
        _check_tensor("v_new", v_new, 4)
        _check_qkv_dtypes_devices(q, k_new, v_new, ("q", "k_new", "v_new"))
        if tuple(k_new.shape) != (B, k_new.shape[1], Hkv, D):
            raise _err("k_new", f"expected shape ({B}, S_new, {Hkv}, {D}), got {tuple(k_new.shape)}")
        if tuple(v_new.shape) != (B, k_new.shape[1], Hkv, Dv):
            raise _err("v_new", f"expected shape ({B}, {k_new.shape[1]}, {Hkv}, {Dv}), got {tuple(v_new.shape)}")
        n_new = k_new.shape[1]
    if value_checks_enabled():
        cs = cache_seqlens.cpu()
        if B and bool((cs < 0).any()):
            raise _err("cache_seqlens", "entries must be >= 0")
        if B and int(cs.max()) + n_new > capacity:
            raise _err("cache_seqlens", f"cache_seqlens ({int(cs.max())}) + new tokens ({n_new}) exceeds "
                                        f"the cache capacity {capacity}")
        if paged and page_table.numel():
            pt = page_table.cpu()
            if bool((pt < 0).any()) or bool((pt >= num_pages).any()):
                raise _err("page_table", f"entries must lie in [0, num_pages={num_pages})")
    window = _clamp_window(window, Sq, capacity)
    spec = AttentionSpec("kvcache", B, Sq, capacity, Hq, Hkv, D, Dv, q.dtype, q.device.type, causal,
                         window, softcap, scale, 0, None, False, bool(return_lse), paged, page_size,
                         n_new, num_splits)
    # the kernels index both with unit strides (a strided view would read other memory)
    cache_seqlens = cache_seqlens.contiguous()
    page_table = page_table.contiguous() if paged else page_table
    return AttentionCall(spec, q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
                         k_new=k_new, v_new=v_new)
