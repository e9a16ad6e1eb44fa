"""Bugs planted on purpose, one at a time, to show that the property suite catches them.

    DUALATTN_PLANT=tile    python -m pytest props -p props.planted ...   # (a)
    DUALATTN_PLANT=lock    ...                                           # (b)
    DUALATTN_PLANT=causal  ...                                           # (c)

(a) ``tile``: one implementation adds 1e-2 to one output tile (query block 1 of 16 rows, head 0,
    first sequence);
(b) ``lock``: dualattn.sparse computes the dQ lock value as the key-block index, not its rank;
(c) ``causal``: one implementation lets query i see key i + Sk - Sq + 1 (off by one on the diagonal).

The implementation planted into is the first of family ``torch`` (the one every machine runs), or
the one named by DUALATTN_PLANT_IMPL. Each plant is a context manager that restores everything;
as a pytest plugin (``-p props.planted``) it is active for the whole session.
"""
from __future__ import annotations

import contextlib
import os

import torch

from dualattn import dispatch

TILE_ROWS = slice(16, 32)  # query block 1 with block_m = 16
PERTURBATION = 1e-2


def target_impl():
    name = os.environ.get("DUALATTN_PLANT_IMPL")
    impls = dispatch.implementations()
    if name:
        for i in impls:
            if i.name == name:
                return i
        raise ValueError(f"DUALATTN_PLANT_IMPL={name!r}: no such implementation ({[i.name for i in impls]})")
    return dispatch.implementations("torch")[0]


@contextlib.contextmanager
def _replace_methods(impl, **methods):
    saved = {m: impl.__dict__[m] for m in methods if m in impl.__dict__}
    for m, f in methods.items():
        setattr(impl, m, f)
    # api.attention replays remembered launchers without calling forward: forget them while the
    # plant is in, and after
    dispatch.LAUNCH_MEMO.clear()
    try:
        yield impl
    finally:
        for m in methods:
            if m in saved:
                setattr(impl, m, saved[m])
            else:
                delattr(impl, m)
        dispatch.LAUNCH_MEMO.clear()


@contextlib.contextmanager
def perturbed_tile(impl=None):
    """(a) add PERTURBATION to one output tile of one implementation's forward."""
    impl = impl or target_impl()
    orig = impl.forward

    def forward(call):
        out, lse = orig(call)
        out = out.clone()
        if out.dim() == 4:      # (B, S, H, Dv): batched and kv-cache
            out[0, TILE_ROWS, 0] += PERTURBATION
        else:                   # (total, H, Dv): varlen, first rows of the packing
            out[TILE_ROWS, 0] += PERTURBATION
        return out, lse

    with _replace_methods(impl, forward=forward):
        yield impl


@contextlib.contextmanager
def causal_off_by_one(impl=None):
    """(c) the implementation's causal diagonal moves one key to the right.

    The torch implementation takes its element predicate from dualattn.reference.torch_ref; the
    shifted predicate is swapped in only while this implementation runs, never for the oracle."""
    from dualattn.reference import torch_ref

    impl = impl or target_impl()
    good = torch_ref.element_visible

    def shifted(rows, cols, seqlen_q, seqlen_k, *, causal=False, window=(-1, -1), key_ranges=None):
        vis = good(rows, cols, seqlen_q, seqlen_k, causal=False, window=window, key_ranges=key_ranges)
        if causal:
            diag = rows.to(torch.int64)[:, None] + (seqlen_k - seqlen_q)
            vis = vis & (cols.to(torch.int64)[None, :] <= diag + 1)  # should be <= diag
        return vis

    def wrap(f):
        def run(*a, **kw):
            torch_ref.element_visible = shifted
            try:
                return f(*a, **kw)
            finally:
                torch_ref.element_visible = good
        return run

    with _replace_methods(impl, forward=wrap(impl.forward), backward=wrap(impl.backward)):
        yield impl


@contextlib.contextmanager
def index_locks():
    """(b) lock value = key-block index (the k2q row) instead of the rank among visitors."""
    from dualattn import sparse

    good = sparse.compute_lock_values

    def by_index(q2k_full, q2k_mask, k2q_full, k2q_mask, n_qblocks, n_kblocks):
        out = []
        for csr in (k2q_full, k2q_mask):
            row, valid = sparse._row_of_entry(csr)
            out.append(torch.where(valid, row, torch.zeros_like(row)).to(torch.int32))
        return tuple(out)

    sparse.compute_lock_values = by_index
    try:
        yield
    finally:
        sparse.compute_lock_values = good


PLANTS = {"tile": perturbed_tile, "lock": index_locks, "causal": causal_off_by_one}

# ---- as a pytest plugin --------------------------------------------------------------------
_active = None


def pytest_configure(config):
    global _active
    name = os.environ.get("DUALATTN_PLANT", "")
    if name:
        if name not in PLANTS:
            raise ValueError(f"DUALATTN_PLANT={name!r}: choose one of {', '.join(PLANTS)}")
        _active = PLANTS[name]()
        _active.__enter__()


def pytest_unconfigure(config):
    global _active
    if _active is not None:
        _active.__exit__(None, None, None)
        _active = None


def pytest_report_header(config):
    name = os.environ.get("DUALATTN_PLANT", "")
    return [f"dualattn PLANTED BUG ACTIVE: {name}"] if name else []
