"""Every bad input fails before anything runs, with ValueError/TypeError naming the argument."""
import pytest
import torch

import dualattn
from dualattn import BlockSparse

F16 = torch.float16


def qkv(b=2, sq=16, sk=24, hq=4, hkv=2, d=32, dv=None, dtype=F16):
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype),
            torch.randn(b, sk, hkv, dv or d, dtype=dtype))


def raises(exc, match, fn, *a, **kw):
    with pytest.raises(exc, match=match):
        fn(*a, **kw)


# ---- dense ---------------------------------------------------------------------------------

def test_dtype_mismatch():
    q, k, v = qkv()
    raises(TypeError, r"^k: dtype", dualattn.attention, q, k.float(), v)


def test_unsupported_dtype():
    q, k, v = qkv()
    raises(TypeError, r"^q: dtype", dualattn.attention, q.double(), k.double(), v.double())


def test_not_a_tensor():
    q, k, v = qkv()
    raises(TypeError, r"^v: expected a torch.Tensor", dualattn.attention, q, k, v.numpy())


def test_device_mismatch_meta():
    q, k, v = qkv()
    raises(ValueError, r"^k: on device meta", dualattn.attention, q, k.to("meta"), v)


def test_rank_mismatch():
    q, k, v = qkv()
    raises(ValueError, r"^q: expected 4 dimensions", dualattn.attention, q[0], k, v)


def test_batch_mismatch():
    q, k, v = qkv()
    raises(ValueError, r"^k: batch", dualattn.attention, q, k[:1], v[:1])


def test_head_dim_mismatch():
    q, k, v = qkv()
    raises(ValueError, r"^k: head dim", dualattn.attention, q, k[..., :16], v)


def test_v_shape_mismatch():
    q, k, v = qkv()
    raises(ValueError, r"^v: shape", dualattn.attention, q, k, v[:, :5])


def test_heads_not_divisible():
    q, k, v = qkv(hq=4, hkv=3)
    raises(ValueError, r"^k: number of query heads \(4\) must be a multiple", dualattn.attention, q, k, v)


@pytest.mark.parametrize("d", [4, 12, 264, 512])
def test_head_dim_unsupported(d):
    q, k, v = qkv(d=d)
    raises(ValueError, r"^q: head dim", dualattn.attention, q, k, v)


def test_value_head_dim_unsupported():
    q, k, v = qkv(dv=20)
    raises(ValueError, r"^v: head dim 20", dualattn.attention, q, k, v)


@pytest.mark.parametrize("w", [(-2, 0), (0, -5)])
def test_window_values(w):
    q, k, v = qkv()
    raises(ValueError, r"^window: entries", dualattn.attention, q, k, v, window=w)


def test_window_type():
    q, k, v = qkv()
    raises(TypeError, r"^window", dualattn.attention, q, k, v, window=(1.5, 0))
    raises(TypeError, r"^window", dualattn.attention, q, k, v, window=3)


def test_softcap_negative():
    q, k, v = qkv()
    raises(ValueError, r"^softcap: must be >= 0", dualattn.attention, q, k, v, softcap=-1.0)


def test_scale_bad():
    q, k, v = qkv()
    raises(ValueError, r"^scale", dualattn.attention, q, k, v, scale=0.0)


def test_causal_not_bool():
    q, k, v = qkv()
    raises(TypeError, r"^causal", dualattn.attention, q, k, v, causal=1)


def test_value_checks_of_a_reused_tensor_run_once_and_again_after_an_in_place_change():
    # cu_seqlens and key ranges passed unchanged in every layer are read back (a
    # synchronisation) once; an in-place update through torch is checked again before running
    import gc

    from dualattn.spec import VALUE_CHECK_MEMO
    q, k, v, cu, m = vl()
    reads = []
    real_cpu = torch.Tensor.cpu
    try:
        torch.Tensor.cpu = lambda self, *a, **kw: (reads.append(self.dtype), real_cpu(self, *a, **kw))[1]
        for _ in range(3):
            dualattn.attention_varlen(q, k, v, cu, cu, m, m, impl="torch")
    finally:
        torch.Tensor.cpu = real_cpu
    assert reads.count(torch.int32) == 1  # one tensor, one read, not one per call
    cu[1] += 20  # in place: no longer monotone
    raises(ValueError, r"^cu_seqlens_q: must be non-decreasing", dualattn.attention_varlen, q, k, v, cu, cu, m, m)
    kr = _kr(1, 1, 16, 1, 0, 3)
    qd, kd, vd = qkv()
    dualattn.attention(qd, kd, vd, key_ranges=kr, impl="torch")
    kr[..., 1] = 25
    raises(ValueError, r"^key_ranges: interval ends", dualattn.attention, qd, kd, vd, key_ranges=kr)
    raises(ValueError, r"^key_ranges: interval ends", dualattn.attention, qd, kd, vd, key_ranges=kr)
    # another check of the same tensor (another Sk) is its own entry
    kr[..., 1] = 3
    dualattn.attention(qd, kd, vd, key_ranges=kr, impl="torch")
    raises(ValueError, r"^key_ranges: interval ends", dualattn.attention, qd[:, :, :, :], kd[:, :2], vd[:, :2],
           key_ranges=kr)
    # the memo holds weak references only: it keeps no tensor alive
    n = len(VALUE_CHECK_MEMO._seen)
    assert n > 0
    del kr
    gc.collect()
    assert any(r() is None for refs, _ in VALUE_CHECK_MEMO._seen.values() for r in refs)



def test_checked_cu_seqlens_keep_their_host_values_until_changed():
    # the value checks' read of cu_seqlens is kept (FastSm90Forward.varlen_unit_table plans by
    # it without a read of its own), under the memo's identity and version rule
    from dualattn.spec import VALUE_CHECK_MEMO, set_value_checks
    q, k, v, cu, m = vl()
    assert VALUE_CHECK_MEMO.host_values(cu) is None
    dualattn.attention_varlen(q, k, v, cu, cu, m, m, impl="torch")
    assert VALUE_CHECK_MEMO.host_values(cu) == tuple(cu.tolist())
    assert VALUE_CHECK_MEMO.host_values(cu.clone()) is None  # another tensor
    cu[-1] += 0  # an in-place write moves the version counter
    assert VALUE_CHECK_MEMO.host_values(cu) is None
    set_value_checks(False)
    try:
        dualattn.attention_varlen(q, k, v, cu, cu, m, m, impl="torch")
        assert VALUE_CHECK_MEMO.host_values(cu) is None  # nothing read with the checks off
    finally:
        set_value_checks(True)
    # inference tensors (no version counter) are checked on every call, which takes the copy again
    with torch.inference_mode():
        cu_inf = cu.clone()
        cu_inf[-1] = cu[-1]
        dualattn.attention_varlen(q, k, v, cu_inf, cu_inf, m, m, impl="torch")
        assert VALUE_CHECK_MEMO.host_values(cu_inf) == tuple(cu_inf.tolist())


def test_unknown_impl():
    q, k, v = qkv()
    raises(ValueError, r"^impl: must be one of", dualattn.attention, q, k, v, impl="cuda")


# ---- key ranges ----------------------------------------------------------------------------

def _kr(b, h, s, r, lo, hi):
    t = torch.zeros(b, h, s, r, 2, dtype=torch.int32)
    t[..., 0], t[..., 1] = lo, hi
    return t


def test_key_ranges_lo_gt_hi():
    q, k, v = qkv()
    raises(ValueError, r"^key_ranges: every interval needs lo <= hi", dualattn.attention, q, k, v,
           key_ranges=_kr(1, 1, 16, 1, 5, 3))


def test_key_ranges_out_of_range():
    q, k, v = qkv()
    raises(ValueError, r"^key_ranges: interval ends must lie in \[0, Sk=24\]", dualattn.attention, q, k, v,
           key_ranges=_kr(1, 1, 16, 1, 0, 25))
    raises(ValueError, r"^key_ranges: interval ends", dualattn.attention, q, k, v, key_ranges=_kr(1, 1, 16, 1, -1, 3))


def test_key_ranges_shape_and_dtype():
    q, k, v = qkv()
    raises(ValueError, r"^key_ranges: expected shape", dualattn.attention, q, k, v, key_ranges=_kr(1, 3, 16, 1, 0, 3))
    raises(ValueError, r"^key_ranges: expected shape", dualattn.attention, q, k, v, key_ranges=_kr(1, 1, 15, 1, 0, 3))
    raises(TypeError, r"^key_ranges: must be int32", dualattn.attention, q, k, v,
           key_ranges=_kr(1, 1, 16, 1, 0, 3).long())


# ---- block sparse --------------------------------------------------------------------------

def _csr(rowptr, col):
    return torch.tensor(rowptr, dtype=torch.int32), torch.tensor(col, dtype=torch.int32)


def _empty(nq):
    return _csr([0] * (nq + 1), [0])


def test_csr_unsorted():
    frp, fcol = _csr([0, 2, 2], [1, 0])
    with pytest.raises(ValueError, match=r"full_col: indices in a row must be sorted"):
        BlockSparse.from_csr(frp, fcol, *_empty(2), 8, 8, 16, 24)


def test_csr_duplicate():
    frp, fcol = _csr([0, 2, 2], [1, 1])
    with pytest.raises(ValueError, match=r"without duplicates"):
        BlockSparse.from_csr(frp, fcol, *_empty(2), 8, 8, 16, 24)


def test_csr_out_of_range():
    frp, fcol = _csr([0, 1, 1], [3])
    with pytest.raises(ValueError, match=r"full_col: key block index out of range \[0, 3\)"):
        BlockSparse.from_csr(frp, fcol, *_empty(2), 8, 8, 16, 24)


def test_csr_inconsistent_counts():
    frp, fcol = _csr([0, 2, 1], [0, 1])
    with pytest.raises(ValueError, match=r"counts inconsistent"):
        BlockSparse.from_csr(frp, fcol, *_empty(2), 8, 8, 16, 24)
    frp, fcol = _csr([0, 2, 3], [0, 1])
    with pytest.raises(ValueError, match=r"last entry exceeds"):
        BlockSparse.from_csr(frp, fcol, *_empty(2), 8, 8, 16, 24)
    frp, fcol = _csr([0, 1], [0])
    with pytest.raises(ValueError, match=r"must be n_qblocks \+ 1"):
        BlockSparse.from_csr(frp, fcol, *_empty(2), 8, 8, 16, 24)


def test_csr_full_and_mask_overlap():
    frp, fcol = _csr([0, 1, 1], [0])
    with pytest.raises(ValueError, match=r"both as full and as mask"):
        BlockSparse.from_csr(frp, fcol, frp, fcol, 8, 8, 16, 24)


def test_csr_dtype():
    with pytest.raises(TypeError, match=r"full_rowptr: must be int32"):
        BlockSparse.from_csr(torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), *_empty(2),
                             8, 8, 16, 24)


def test_csr_block_size_not_positive():
    # a zero block size used to escape validation as ZeroDivisionError
    for bm, bn in ((0, 8), (8, 0), (-8, 8)):
        with pytest.raises(ValueError, match=r"block_sparse: block size must be positive"):
            BlockSparse.from_csr(*_empty(2), *_empty(2), bm, bn, 16, 24)
        with pytest.raises(ValueError, match=r"block_sparse: block size must be positive"):
            BlockSparse.from_csr(*_empty(2), *_empty(2), bm, bn, 16, 24, validate=False)
        with pytest.raises(ValueError, match=r"block_sparse: block size must be positive"):
            BlockSparse.from_key_ranges(None, 16, 24, bm, bn)


def test_csr_arrays_on_different_devices():
    # a CSR array on another device than the others used to pass, then crash in the kernel
    q, k, v = qkv()
    frp, fcol = _csr([0, 1, 1], [0])
    bs = BlockSparse.from_csr(frp, fcol.to("meta"), *_empty(2), 8, 8, 16, 24, validate=False)
    raises(ValueError, r"^block_sparse full_col: on device meta", dualattn.attention, q, k, v, block_sparse=bs,
           impl="torch")


def test_block_sparse_wrong_shape_for_call():
    q, k, v = qkv()
    bs = BlockSparse.from_key_ranges(None, 32, 24, 8, 8)
    raises(ValueError, r"^block_sparse: built for seqlen", dualattn.attention, q, k, v, block_sparse=bs)
    bs = BlockSparse.from_key_ranges(_kr(3, 1, 16, 1, 0, 24), 16, 24, 8, 8)
    raises(ValueError, r"^block_sparse: batch dim 3", dualattn.attention, q, k, v, block_sparse=bs)
    raises(TypeError, r"^block_sparse: expected dualattn.BlockSparse", dualattn.attention, q, k, v, block_sparse=[1])


# ---- varlen --------------------------------------------------------------------------------

def vl(lengths=(5, 0, 9), hq=4, hkv=2, d=32):
    t = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    return (torch.randn(t, hq, d, dtype=F16), torch.randn(t, hkv, d, dtype=F16), torch.randn(t, hkv, d, dtype=F16),
            cu, max(lengths))


def test_cu_seqlens_dtype():
    q, k, v, cu, m = vl()
    raises(TypeError, r"^cu_seqlens_q: must be int32", dualattn.attention_varlen, q, k, v, cu.long(), cu, m, m)


def test_cu_seqlens_not_monotone():
    q, k, v, cu, m = vl()
    bad = torch.tensor([0, 9, 5, 14], dtype=torch.int32)
    raises(ValueError, r"^cu_seqlens_k: must be non-decreasing", dualattn.attention_varlen, q, k, v, cu, bad, m, 9)


def test_cu_seqlens_wrong_length():
    q, k, v, cu, m = vl()
    raises(ValueError, r"^cu_seqlens_k: length 3 differs", dualattn.attention_varlen, q, k, v, cu, cu[:3].clone(), m, m)
    raises(ValueError, r"^cu_seqlens_q: must be 1-D", dualattn.attention_varlen, q, k, v, cu[:1].clone(), cu, m, m)


def test_cu_seqlens_last_entry():
    q, k, v, cu, m = vl()
    bad = cu.clone()
    bad[-1] = 13
    raises(ValueError, r"^cu_seqlens_q: last entry 13 must equal the number of packed tokens 14",
           dualattn.attention_varlen, q, k, v, bad, cu, m, m)


def test_cu_seqlens_first_entry():
    q, k, v, cu, m = vl()
    bad = cu.clone()
    bad[0] = 1
    raises(ValueError, r"^cu_seqlens_q: must start at 0", dualattn.attention_varlen, q, k, v, bad, cu, m, m)


def test_max_seqlen_too_small():
    q, k, v, cu, m = vl()
    raises(ValueError, r"^max_seqlen_k: 8 is smaller than the longest sequence 9", dualattn.attention_varlen,
           q, k, v, cu, cu, m, 8)
    raises(TypeError, r"^max_seqlen_q", dualattn.attention_varlen, q, k, v, cu, cu, 9.0, 9)


def test_varlen_rank():
    q, k, v, cu, m = vl()
    raises(ValueError, r"^q: expected 3 dimensions", dualattn.attention_varlen, q[None], k, v, cu, cu, m, m)


# ---- kv cache ------------------------------------------------------------------------------

def kvc(b=2, cap=32, hq=4, hkv=2, d=32):
    return (torch.randn(b, 1, hq, d, dtype=F16), torch.randn(b, cap, hkv, d, dtype=F16),
            torch.randn(b, cap, hkv, d, dtype=F16))


def test_cache_seqlens_exceeds_capacity():
    q, kc, vc = kvc()
    raises(ValueError, r"^cache_seqlens: .* exceeds the cache capacity 32", dualattn.attention_with_kvcache, q, kc, vc,
           cache_seqlens=torch.tensor([3, 33], dtype=torch.int32))
    kn = torch.randn(2, 2, 2, 32, dtype=F16)
    raises(ValueError, r"^cache_seqlens: .* exceeds", dualattn.attention_with_kvcache, q, kc, vc,
           cache_seqlens=torch.tensor([31, 3], dtype=torch.int32), k_new=kn, v_new=kn)


def test_cache_seqlens_dtype_shape():
    q, kc, vc = kvc()
    raises(TypeError, r"^cache_seqlens: must be int32", dualattn.attention_with_kvcache, q, kc, vc,
           cache_seqlens=torch.tensor([3, 3]))
    raises(ValueError, r"^cache_seqlens: expected shape \(2,\)", dualattn.attention_with_kvcache, q, kc, vc,
           cache_seqlens=torch.tensor([3], dtype=torch.int32))


def test_page_table_out_of_range():
    q = torch.randn(2, 1, 4, 32, dtype=F16)
    kc = torch.randn(6, 16, 2, 32, dtype=F16)  # 6 pages of 16
    table = torch.tensor([[0, 1], [2, 6]], dtype=torch.int32)
    raises(ValueError, r"^page_table: entries must lie in \[0, num_pages=6\)", dualattn.attention_with_kvcache, q, kc,
           kc, cache_seqlens=torch.tensor([3, 20], dtype=torch.int32), page_table=table)
    raises(ValueError, r"^cache_seqlens: .* exceeds the cache capacity 32", dualattn.attention_with_kvcache, q, kc,
           kc, cache_seqlens=torch.tensor([3, 40], dtype=torch.int32), page_table=table.clamp(max=5))


def test_k_new_without_v_new():
    q, kc, vc = kvc()
    kn = torch.randn(2, 1, 2, 32, dtype=F16)
    raises(ValueError, r"^k_new: k_new and v_new must be given together", dualattn.attention_with_kvcache, q, kc, vc,
           cache_seqlens=torch.tensor([3, 3], dtype=torch.int32), k_new=kn)


def test_num_splits_bad():
    q, kc, vc = kvc()
    raises(ValueError, r"^num_splits", dualattn.attention_with_kvcache, q, kc, vc,
           cache_seqlens=torch.tensor([3, 3], dtype=torch.int32), num_splits=-1)


def test_block_sparse_built_for_other_lengths_same_block_counts():
    # 16 x 24 and 10 x 24 have the same block counts with blocks of 8/16, but under bottom-right
    # causal the diagonal sits elsewhere: the pattern's full blocks would be wrong
    q, k, v = qkv(sq=10, sk=24)
    bs = BlockSparse.from_key_ranges(None, 16, 24, 16, 8, causal=True)
    raises(ValueError, r"^block_sparse: built for seqlen \(16, 24\)", dualattn.attention, q, k, v, causal=True,
           block_sparse=bs)


def test_tensor_scale_changed_in_place_is_not_served_from_the_memo():
    # a 0-d tensor scale hashes by identity; the dense-spec memo must not hand back its old value
    q, k, v = (torch.randn(1, 8, 2, 32) for _ in range(3))
    t = torch.tensor(0.5)
    first = dualattn.attention(q, k, v, scale=t, impl="torch")
    t.fill_(0.05)
    again = dualattn.attention(q, k, v, scale=t, impl="torch")
    assert torch.equal(again, dualattn.attention(q, k, v, scale=0.05, impl="torch"))
    assert not torch.equal(again, first)
    t.fill_(-1.0)
    with pytest.raises(ValueError, match="scale"):
        dualattn.attention(q, k, v, scale=t, impl="torch")


def test_strided_cu_seqlens_are_read_as_their_values():
    from dualattn import spec as spec_mod
    q, k, v = (torch.randn(16, 2, 32) for _ in range(3))
    table = torch.tensor([[0, 5], [8, 3], [16, 7]], dtype=torch.int32)
    cu = table[:, 0]  # values [0, 8, 16], stride 2
    call = spec_mod.build_varlen(q, k, v, cu, cu, 8, 8, causal=True)
    assert call.cu_seqlens_q.is_contiguous() and call.cu_seqlens_k.is_contiguous()
    got = dualattn.attention_varlen(q, k, v, cu, cu, 8, 8, causal=True, impl="torch")
    want = dualattn.attention_varlen(q, k, v, cu.contiguous(), cu.contiguous(), 8, 8, causal=True, impl="torch")
    assert torch.equal(got, want)


def test_varlen_window_clamp_ignores_an_overstated_max_seqlen():
    from dualattn import spec as spec_mod
    q, k, v = (torch.randn(16, 1, 32) for _ in range(3))
    cu = torch.tensor([0, 16], dtype=torch.int32)
    call = spec_mod.build_varlen(q, k, v, cu, cu, 16, 2 ** 31 - 16, window=(-1, 2 ** 31 - 1))
    assert call.spec.window == (-1, 32)


def test_wide_index_tensors_are_flagged_and_refused_by_32_bit_kernels():
    from dataclasses import replace
    from dualattn import spec as spec_mod
    from dualattn.fast.sm90 import FastSm90Forward
    assert spec_mod._wide_index_tensors(torch.empty(2 ** 31, dtype=torch.int32, device="meta"), None)
    assert not spec_mod._wide_index_tensors(torch.empty(2 ** 31 - 1, dtype=torch.int32, device="meta"), None)
    q, k, v = (torch.randn(1, 8, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    spec = replace(spec_mod.build_dense(q, k, v).spec, device_type="cuda", num_key_ranges=1)
    assert FastSm90Forward().can_implement_static(spec) is None
    reason = FastSm90Forward().can_implement_static(replace(spec, wide_index_tensors=True))
    assert reason and "2**31" in reason


def test_value_checks_under_inference_mode_run_every_call():
    # tensors made under torch.inference_mode count no in-place changes: they are checked on
    # every call (and never remembered), so an update between calls is still refused
    with torch.inference_mode():
        q, k, v, cu, m = vl()
        dualattn.attention_varlen(q, k, v, cu, cu, m, m, impl="torch")
        cu[1] += 20
        raises(ValueError, r"^cu_seqlens_q: must be non-decreasing", dualattn.attention_varlen, q, k, v, cu, cu, m, m)
        st = torch.tensor([[[[2, 0], [0, 2]]]], dtype=torch.int8)
        bs = BlockSparse.from_block_states(st, 16, 16, 32, 32)
        qd, kd, vd = (torch.randn(1, 32, 2, 16) for _ in range(3))
        dualattn.attention(qd, kd, vd, block_sparse=bs, impl="torch")
        bs.q2k_full.col.fill_(5)
        raises(ValueError, r"out of range", dualattn.attention, qd, kd, vd, block_sparse=bs, impl="torch")
