"""SASS of the fast-sm90 kernels (CPU, compile_only): assembled for sm_90a by the ptxas that Triton
ships, disassembled by its cuobjdump. Guards two code-generation regressions found on the H100:

* a mask written as ``if hidden: frag[i] = -inf`` made the DSL's if-region yield the whole register
  fragment and ptxas re-selected every earlier element at each condition (hd128 causal: 2025
  ``FSEL``, 24 bytes of spills; now one select per element: 134);
* P packed into its 32-bit wgmma operands after the GEMM's fence made ptxas inject a
  ``warpgroup.arrive`` before each P V wgmma (warning C7519, hd192 / hd256).
"""
from __future__ import annotations

import collections

import re

import pytest
import torch

pytest.importorskip("cutlass")

from dualattn.spec import AttentionSpec  # noqa: E402
from dualattn.fast.sm90 import FastSm90Forward  # noqa: E402
from dualattn.fast.sm90.sass import (assemble, exp2_spacing, key_block_loops, loop_budget,  # noqa: E402
                                    opcode, registers_live_through, steady_loop)

def _spec(d, causal, sq, **kw):
    return AttentionSpec("batched", 2, sq, sq, 8, 8, d, d, torch.bfloat16, "cuda", causal=causal,
                         return_lse=True, **kw)


# (id, spec, spill bytes allowed). The 3-warpgroup causal hd64 tile (160 registers per consumer
# thread) spilled one register in ptxas 12.9 (4 bytes); it was measured faster than 2 warpgroups
# all the same (docs/bench-h100-20261124.md section 15). Before the mask fix it spilled 308 bytes.
# With one epilogue per warpgroup (section 19) ptxas kept the 16 swizzled shared-memory addresses
# of O's staging live from before the tile loop and spilled 3 registers (12 bytes); since they are
# computed in each tile's epilogue (FastSm90Forward.staging_per_tile, section 32) it spills none.
CONFIGS = [
    ("hd128-causal-1k", _spec(128, True, 1024), 0),
    ("hd64-causal-8k-3wg", _spec(64, True, 8192), 0),
    ("hd128-window", _spec(128, True, 4096, window=(256, 0)), 0),
    ("hd128-tail", _spec(128, False, 1000), 0),
    ("hd256-causal", _spec(256, True, 2048), 0),
    ("hd256", _spec(256, False, 8192), 0),
    ("hd192", _spec(192, False, 8192), 0),
]


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,spec,spill_bytes", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_sass_has_no_select_chain_no_spills_no_injected_arrives(name, spec, spill_bytes, tmp_path):
    tile_m, tile_n = FastSm90Forward.config(spec)[:2]
    ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
    log, sass = assemble(ptx, str(tmp_path))
    assert "C7519" not in log, "ptxas injected warpgroup.arrive before a wgmma"
    # (C7511: a P V over half the keys in a run-time branch made ptxas serialize every wgmma of
    # the kernel at hd128: docs section 24)
    assert "serialized" not in log, "ptxas serialized the wgmma chain"
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and max(spills) <= spill_bytes, log[-500:]
    assert any("HGMMA" in ln for ln in sass)
    # whatever spills stays out of the key-block loops (the innermost loops that issue HGMMA)
    loops = key_block_loops(sass)
    assert loops
    for lo, hi in loops:
        local = [ln for ln in sass[lo:hi + 1] if re.search(r"\b(STL|LDL)\b", ln)]
        assert not local, (name, local[:4])
    # one select per masked element and bound: a consumer thread holds 64 * tile_n / 128 scores;
    # a few masked sites (first block, masked loops, tail) with up to two bounds each stay far
    # below the quadratic chain (2025 selects for hd128 causal)
    per_thread = 64 * tile_n // 128
    fsel = sum("FSEL" in ln for ln in sass)
    assert fsel <= 8 * per_thread, (name, fsel)


def _guarded_runs(sass, length):
    """Conditional branches followed by at least ``length`` FMULs in a row (a skippable rescale)."""
    ops = [ln.split(";")[0].split("*/")[-1].split() for ln in sass]
    hits = 0
    for i, op in enumerate(ops):
        if len(op) >= 2 and op[0].startswith("@") and op[1] == "BRA":
            run = 0
            while i + 1 + run < len(ops) and ops[i + 1 + run] and ops[i + 1 + run][0] == "FMUL":
                run += 1
            hits += run >= length
    return hits


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d,on", [(256, True), (192, True), (128, False)])
def test_sass_skips_o_rescale_behind_a_branch_where_the_threshold_is_on(d, on, tmp_path):
    """From Dv 192 the online softmax keeps a row's max until it grows by more than 2^8, and O's
    rescale (Dv / 2 FMULs per thread) sits behind a branch the warp takes only when a row moved
    (FastSm90Forward.rescale_threshold); below, O is rescaled unconditionally."""
    spec = _spec(d, False, 8192)
    assert (FastSm90Forward.rescale_threshold(spec) > 0) == on
    _, sass = assemble(FastSm90Forward().compile_only(spec, arch=90).__ptx__, str(tmp_path))
    assert (_guarded_runs(sass, d // 2) > 0) == on


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d,causal,sq", [(64, False, 8192), (128, True, 4096), (256, False, 8192)])
def test_steady_loop_issues_one_block_and_its_exponentials_within_budget(d, causal, sq, tmp_path):
    """The unmasked key-block loop issues exactly one key block's GEMMs (S = Q K^T and O += P V of
    a 64-row warpgroup tile) and one MUFU per exponential the softmax needs: tile_n / 2 scores
    and 2 row corrections per thread. At hd64 the MUFU time already matches the tensor cores'
    (ci/sm90_loop_budget.py: 1584 against 1536 clocks per key block and sub-partition), and the
    loop's issue must stay under 0.9 of the tensor time (today 0.84): instructions added there
    cost speed directly (docs section 23)."""
    spec = _spec(d, causal, sq)
    tile_m, tile_n = FastSm90Forward.config(spec)[:2]
    controls = []
    _, sass = assemble(FastSm90Forward().compile_only(spec, arch=90).__ptx__, str(tmp_path), controls)
    lo, hi = steady_loop(sass)
    budget = loop_budget(sass[lo:hi + 1], tile_m // 64)
    assert budget["tensor_clk"] * 4096 == (tile_m // 64) * 2 * 64 * tile_n * 2 * d, budget
    assert budget["mufu"] == tile_n // 2 + 2, budget
    if d == 64:
        assert budget["issue_clk"] <= 0.9 * budget["tensor_clk"], budget
    # ptxas spaces one warp's exponentials by stall counts: at least the 8 clocks a warp's
    # MUFU.EX2 takes its sub-partition's MUFU quarter (docs section 39; ci/sm90_sass_stalls.py),
    # so 64 exponentials hold a warp's stream for 512 clocks a block whatever else is ready.
    # Mostly exactly 8: where nothing else is ready ptxas pads to that rate and no more (a
    # misread control field gives no gap of 8)
    assert len(controls) == len(sass) and None not in controls
    _, gaps = exp2_spacing(sass[lo:hi + 1], controls[lo:hi + 1])
    assert len(gaps) == budget["mufu"] - 1 and min(gaps) >= 8 and gaps.count(8) > len(gaps) // 2, gaps


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("bit_mask", ["", "0"])
def test_masked_loops_test_bits_not_keys_where_bit_masks_are_on(bit_mask, tmp_path, monkeypatch):
    """With masks from a bit set per row (FastSm90Forward.bit_mask) a masked key-block loop of a
    window config holds about as many integer compares as the unmasked one and moves the bits
    into predicates with R2P; with a compare per element and bound (DUALATTN_SM90_BIT_MASK=0,
    the planted contrast) it holds 128 more compares. (With the three loops of configs without
    narrow_last; test_narrow_last_runs_every_masked_block_in_one_loop covers the one loop.)"""
    import dualattn.fast.sm90 as sm90
    monkeypatch.setattr(sm90, "_BIT_MASK_ENV", bit_mask)
    monkeypatch.setattr(sm90, "_NARROW_LAST_ENV", "0")
    spec = _spec(128, True, 16384, window=(1024, 0))
    assert FastSm90Forward.bit_mask(spec) == (bit_mask == "")
    _, sass = assemble(FastSm90Forward().compile_only(spec, arch=90).__ptx__, str(tmp_path))
    count = lambda lo, hi, op: sum(f" {op}" in ln for ln in sass[lo:hi + 1])
    steady = count(*steady_loop(sass), "ISETP")
    masked = [(lo, hi) for lo, hi in key_block_loops(sass) if count(lo, hi, "FSEL") > 8]
    assert len(masked) == 2   # the blocks on the diagonal and those across the window's lower edge
    for lo, hi in masked:
        if bit_mask == "":
            assert count(lo, hi, "ISETP") <= steady + 8 and count(lo, hi, "R2P") >= 4
        else:
            assert count(lo, hi, "ISETP") >= steady + 64 and count(lo, hi, "R2P") == 0


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_narrow_last_runs_every_masked_block_in_one_loop(tmp_path):
    """FastSm90Forward.narrow_last (a window config, D = 128): the masked blocks after the first
    run in one key-block loop that holds both the full masked step (N = 128 Q K^T) and the narrow
    one (N = 64), with bit masks (R2P); the unmasked loop holds no mask; the wgmma descriptors
    stay in uniform registers (a pipeline state advanced inside the branch once moved them:
    hundreds of R2UR) and nothing is serialized or spilled."""
    spec = _spec(128, True, 16384, window=(1024, 0))
    assert FastSm90Forward.narrow_last(spec) and FastSm90Forward.narrow_first(spec)
    log, sass = assemble(FastSm90Forward().compile_only(spec, arch=90).__ptx__, str(tmp_path))
    assert "serialized" not in log and "C75" not in log, log[-500:]
    assert max(int(n) for n in re.findall(r"(\d+) bytes spill stores", log)) == 0
    count = lambda lo, hi, op: sum(op in ln for ln in sass[lo:hi + 1])
    loops = key_block_loops(sass)
    masked = [(lo, hi) for lo, hi in loops if count(lo, hi, " FSEL") > 8]
    assert len(masked) == 1, [(lo, hi, count(lo, hi, " FSEL")) for lo, hi in loops]
    lo, hi = masked[0]
    assert count(lo, hi, "HGMMA.64x64x16") > 0 and count(lo, hi, "HGMMA.64x128x16") > 0
    assert count(lo, hi, " R2P") >= 4
    lo, hi = steady_loop(sass)
    assert count(lo, hi, " FSEL") <= 8 and count(lo, hi, "HGMMA.64x64x16") == 0  # (no mask there)
    assert sum("R2UR" in ln for ln in sass) < 64


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,spec", [
    ("key-ranges-causal", _spec(128, True, 16384, num_key_ranges=1)),
    ("key-ranges-hd64", _spec(64, False, 4096, num_key_ranges=2)),
    ("window", _spec(128, True, 16384, window=(1024, 0))),
    ("causal", _spec(128, True, 1024)),
], ids=lambda x: x if isinstance(x, str) else "")
def test_key_block_loops_keep_wgmma_descriptors_uniform(name, spec, tmp_path):
    """No key-block loop moves a wgmma descriptor from a per-thread register (R2UR): the
    pipeline state they come from stays warp-uniform. It did not in two cases found in the SASS:
    key ranges, whose loop bound comes from a warp reduction by shuffles (32 R2UR a key block,
    SASS 3016 -> 2440 instructions once marked uniform; docs section 42), and narrow_last's loop
    with the state advanced inside its branch (section 42)."""
    _, sass = assemble(FastSm90Forward().compile_only(spec, arch=90).__ptx__, str(tmp_path))
    loops = key_block_loops(sass)
    assert loops
    for lo, hi in loops:
        assert not any("R2UR" in ln for ln in sass[lo:hi + 1]), (name, lo, hi)


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_plain_noncausal_128_row_tiles_take_q_from_registers(tmp_path):
    """FastSm90Forward.q_regs: plain non-causal batched calls in 128-row tiles at D <= 128 copy Q
    into registers once per tile (LDSM) and every Q K^T reads it there (HGMMA with a register A
    operand, as P V); causal calls keep Q K^T from shared memory (a descriptor A operand)."""
    sm90 = FastSm90Forward
    assert sm90.q_regs(_spec(128, False, 8192)) and sm90.q_regs(_spec(96, False, 2048))
    assert sm90.q_regs(AttentionSpec("batched", 2, 2048, 2048, 32, 8, 128, 128, torch.bfloat16, "cuda"))
    for off in (_spec(128, True, 8192), _spec(128, False, 8192, window=(256, 256)), _spec(64, False, 8192),
                _spec(256, False, 8192),
                AttentionSpec("varlen", 3, 4096, 4096, 8, 8, 128, 128, torch.bfloat16, "cuda")):
        assert not sm90.q_regs(off), off
    rs = re.compile(r"HGMMA\.\S+\s+R\d+,\s*R\d+,")
    for causal in (False, True):
        log, sass = assemble(sm90().compile_only(_spec(128, causal, 8192), arch=90).__ptx__, str(tmp_path))
        gmma = [ln for ln in sass if "HGMMA" in ln]
        ldsm = sum("LDSM" in ln for ln in sass)
        if causal:
            assert ldsm == 0 and any(not rs.search(ln) for ln in gmma)
        else:
            assert ldsm > 0 and all(rs.search(ln) for ln in gmma), gmma[:2]
            assert "0 bytes spill stores" in log


# (id, spec): the 128-row tile with Q in registers, hd64's 192-row tile, a causal tile, hd256's slot
LIVE_CONFIGS = [("hd128", _spec(128, False, 8192)), ("hd64-3wg", _spec(64, False, 8192)),
                ("hd128-causal", _spec(128, True, 8192)), ("hd256", _spec(256, False, 8192))]


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("staging_per_tile", ["", "0"], ids=["per-tile", "hoisted"])
@pytest.mark.parametrize("name,spec", LIVE_CONFIGS, ids=[c[0] for c in LIVE_CONFIGS])
def test_steady_loop_holds_no_epilogue_addresses(name, spec, staging_per_tile, tmp_path, monkeypatch):
    """The steady key-block loop carries few registers it does not use: computed before the tile
    loop, O's staging addresses (16 at hd128) stayed live through every key block and ptxas took
    P's registers for the softmax's temporaries, which put the P V wait before the exponentials
    (docs section 32). The hoisted form is checked too, so that the check can fail: with O
    staged by 32-bit stores it holds 16 or more, with stmatrix (FastSm90Forward.stmatrix_o, one
    address per 8 x 8 matrix) 6 at hd128 (section 35)."""
    import dualattn.fast.sm90 as sm90
    monkeypatch.setattr(sm90, "_STAGING_PER_TILE_ENV", staging_per_tile)
    settings = (("", 5), ("0", 16)) if staging_per_tile == "0" else (("", None),)
    for stmatrix, hoisted_at_least in settings:
        monkeypatch.setattr(sm90, "_STMATRIX_O_ENV", stmatrix)
        _, sass = assemble(FastSm90Forward().compile_only(spec, arch=90).__ptx__, str(tmp_path))
        live = registers_live_through(sass, *steady_loop(sass))
        if staging_per_tile == "0":
            assert len(live) >= hoisted_at_least, (stmatrix, live)
        else:
            assert len(live) <= 4, live


def _hgmma_shapes(lines):
    """HGMMA instructions by shape (e.g. '64x128x16')."""
    shapes = {}
    for ln in lines:
        m = re.search(r"HGMMA\.(\d+x\d+x\d+)", ln)
        if m:
            shapes[m.group(1)] = shapes.get(m.group(1), 0) + 1
    return shapes


# (id, spec): ping-pong causal, 3-warpgroup causal, hd256's 64-key tiles with a right window bound
NARROW_CONFIGS = [("hd128-causal", _spec(128, True, 1024)), ("hd64-causal-3wg", _spec(64, True, 8192)),
                  ("hd256-window", _spec(256, False, 2048, window=(-1, 100)))]


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,spec", NARROW_CONFIGS, ids=[c[0] for c in NARROW_CONFIGS])
def test_narrow_first_block_is_one_half_width_q_k_outside_the_steady_loop(name, spec, tmp_path,
                                                                        monkeypatch):
    """narrow_first adds one Q K^T of N = tile_n / 2 (D / 16 HGMMA) for the tile's first block and
    nothing else: against DUALATTN_SM90_NARROW_FIRST=0 the kernel's HGMMA differ by exactly those,
    and the steady key-block loop's are the same."""
    import dualattn.fast.sm90 as sm90
    monkeypatch.setattr(sm90, "_NARROW_FIRST_ENV", "1")  # (hd256: off by default)
    assert FastSm90Forward.narrow_first(spec)
    tile_n = FastSm90Forward.config(spec)[1]
    half = f"64x{tile_n // 2}x16"
    found = {}
    for knob in ("1", "0"):
        monkeypatch.setattr(sm90, "_NARROW_FIRST_ENV", knob)
        log, sass = assemble(FastSm90Forward().compile_only(spec, arch=90).__ptx__, str(tmp_path))
        assert "serialized" not in log and "C7517" not in log
        lo, hi = steady_loop(sass)
        found[knob] = (_hgmma_shapes(sass), _hgmma_shapes(sass[lo:hi + 1]))
    (all_on, loop_on), (all_off, loop_off) = found["1"], found["0"]
    added = {k: all_on.get(k, 0) - all_off.get(k, 0) for k in set(all_on) | set(all_off)}
    assert {k: v for k, v in added.items() if v} == {half: spec.head_dim // 16}, (all_on, all_off)
    assert loop_on == loop_off


# (id, spec): per-warpgroup epilogue (hd128, hd64's 3 warpgroups), hd256's shared
# slot, and a varlen kernel (whose partial tiles read the staged O back for predicated stores)
STMATRIX_CONFIGS = [("hd128-causal", _spec(128, True, 1024)), ("hd64-3wg", _spec(64, False, 8192)),
                    ("hd256", _spec(256, False, 8192)),
                    ("hd128-varlen", AttentionSpec("varlen", 3, 4096, 4096, 8, 8, 128, 128,
                                                   torch.bfloat16, "cuda", causal=True))]


def _built_both_ways(monkeypatch, knob, spec, tmp_path, rule=None):
    """{value: (ptx, sass)} of ``spec`` compiled with the knob ``knob`` (a module global of
    dualattn.fast.sm90) at its default ("") and off ("0"), each assembled without spills; with
    ``rule`` (a FastSm90Forward rule), that it is on by default and off by the knob. The tests
    below compare the two, so that each check can fail."""
    import dualattn.fast.sm90 as sm90
    built = {}
    for value in ("", "0"):
        monkeypatch.setattr(sm90, knob, value)
        if rule is not None:
            assert rule(spec) is (value == ""), (knob, value)
        ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
        log, sass = assemble(ptx, str(tmp_path))
        assert "0 bytes spill stores" in log, (knob, value)
        built[value] = (ptx, sass)
    return built


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,spec", STMATRIX_CONFIGS, ids=[c[0] for c in STMATRIX_CONFIGS])
def test_o_is_staged_by_stmatrix(name, spec, tmp_path, monkeypatch):
    """FastSm90Forward.stmatrix_o: each consumer thread stages its Dv / 2 values of O with Dv / 16
    STSM (four 8 x 8 matrices per warp instruction) instead of Dv / 4 32-bit STS, and nothing in
    the steady key-block loop changes. The knob off is checked too, so that the check can fail."""
    found = {}
    for knob, (_, sass) in _built_both_ways(monkeypatch, "_STMATRIX_O_ENV", spec, tmp_path).items():
        lo, hi = steady_loop(sass)
        ops = [opcode(ln).split(".")[0] for ln in sass]
        found[knob] = (ops.count("STSM"), ops.count("STS"), ops[lo:hi + 1])
    (stsm_on, sts_on, loop_on), (stsm_off, sts_off, loop_off) = found[""], found["0"]
    dv = spec.head_dim_v
    assert stsm_off == 0 and stsm_on >= dv // 16, (stsm_on, stsm_off)
    assert sts_off - sts_on >= dv // 4 - 4, (sts_on, sts_off)
    # (the same instructions; ptxas may pick IMAD or MOV for a register move, and may order the
    # loop's uniform bookkeeping differently: hd64's key_split loop, docs section 46)
    assert len(loop_on) == len(loop_off)
    same = collections.Counter(o for o in loop_on if o not in ("IMAD", "MOV"))
    assert same == collections.Counter(o for o in loop_off if o not in ("IMAD", "MOV"))


# (id, spec): hd64's 2-warpgroup causal tile and its 3-warpgroup tiles (stream-K's merge keeps
# named barriers of its own there)
WARP_STORE_CONFIGS = [("hd64-causal-2wg", _spec(64, True, 1024)), ("hd64-3wg", _spec(64, False, 8192)),
                      ("hd64-causal-3wg", _spec(64, True, 8192))]


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,spec", WARP_STORE_CONFIGS, ids=[c[0] for c in WARP_STORE_CONFIGS])
def test_warp_store_o_drops_the_epilogue_barriers(name, spec, tmp_path, monkeypatch):
    """FastSm90Forward.warp_store_o: each consumer warp stages its own 16 rows of O and issues
    their TMA store, so the epilogue's two 128-thread named barriers (before and after the
    staging) become two warp syncs; one store site as before, no spills, the steady loop the same
    length. The knob off is compiled too, so that the check can fail."""
    found = {}
    for knob, (ptx, sass) in _built_both_ways(monkeypatch, "_WARP_STORE_O_ENV", spec, tmp_path,
                                               FastSm90Forward.warp_store_o).items():
        lo, hi = steady_loop(sass)
        found[knob] = (len(re.findall(r"bar\.sync\s+%r\d+, 128;", ptx)), ptx.count("bar.warp.sync"),
                       len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared", ptx)), hi - lo)
    (bars_on, warp_on, stores_on, loop_on), (bars_off, warp_off, stores_off, loop_off) = found[""], found["0"]
    assert bars_off - bars_on == 2 and warp_on - warp_off == 2, found
    assert stores_on == stores_off == spec.head_dim_v // 64, found
    assert abs(loop_on - loop_off) <= 2, found


# (id, spec): hd128's per-warpgroup staging, hd64's per-warp stores, hd256's shared O slot
LSE_CONFIGS = [("hd128-causal-1k", _spec(128, True, 1024)), ("hd64-causal-1k", _spec(64, True, 1024)),
               ("hd256-causal-2k", _spec(256, True, 2048))]


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,spec", LSE_CONFIGS, ids=[c[0] for c in LSE_CONFIGS])
def test_lse_stores_follow_the_o_store(name, spec, tmp_path, monkeypatch):
    """FastSm90Forward.lse_after_o: the LSE's global stores (the kernel's only STG here) come
    after the proxy fence that hands O's staging to the TMA (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S)
    and after O's TMA store, so the fence no longer waits for them (docs section 55); with the
    knob off they come before the fence, which checks that the check can fail."""
    for knob, (_, sass) in _built_both_ways(monkeypatch, "_LSE_AFTER_O_ENV", spec, tmp_path,
                                             FastSm90Forward.lse_after_o).items():
        fences = [i for i, ln in enumerate(sass[:-1])
                  if "MEMBAR.ALL.CTA" in ln and "FENCE.VIEW.ASYNC.S" in sass[i + 1]]
        stores = [i for i, ln in enumerate(sass) if opcode(ln).startswith("STG")]
        o_stores = [i for i, ln in enumerate(sass) if opcode(ln).startswith("UTMASTG")]
        assert len(fences) == 1 and len(stores) == 2 and o_stores, (fences, stores, o_stores)
        if knob == "":
            assert min(stores) > max(o_stores) > fences[0], (fences, stores, o_stores)
        else:
            assert max(stores) < fences[0] < min(o_stores), (fences, stores, o_stores)


def test_lse_after_o_where_it_applies():
    """Every config without stream-K code (a stream-K one, hd128 causal 4k, measured slower)."""
    assert FastSm90Forward.lse_after_o(_spec(128, True, 1024))
    assert FastSm90Forward.lse_after_o(_spec(128, False, 1000))
    assert FastSm90Forward.lse_after_o(AttentionSpec("varlen", 3, 4096, 4096, 8, 8, 128, 128,
                                                     torch.bfloat16, "cuda", causal=True))
    assert FastSm90Forward.stream_k(_spec(128, True, 4096))
    assert not FastSm90Forward.lse_after_o(_spec(128, True, 4096))


def test_warp_store_o_where_it_applies():
    """Batched calls at Dv <= 64 with a staging slot per warpgroup; not hd128 (measured slower),
    hd256's shared slot, or varlen (a sequence's partial tile goes out by predicated stores)."""
    assert FastSm90Forward.warp_store_o(_spec(64, True, 1024))
    assert FastSm90Forward.warp_store_o(_spec(64, False, 8192))
    assert not FastSm90Forward.warp_store_o(_spec(128, True, 1024))
    assert not FastSm90Forward.warp_store_o(_spec(256, False, 8192))
    assert not FastSm90Forward.warp_store_o(AttentionSpec("varlen", 3, 4096, 4096, 8, 8, 64, 64,
                                                          torch.bfloat16, "cuda", causal=True))


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_l2_hints_on_the_tma_copies(monkeypatch):
    """FastSm90Forward.l2_hints: at D > 128 every K / V load carries the evict-last policy and
    the Q load and O store the evict-first one (CUTLASS's CacheHintSm90 values); at hd128 no
    copy carries either unless the knob asks for them (=1), so that the check can fail."""
    import dualattn.fast.sm90 as sm90
    from dualattn.fast.sm90.flash_fwd import L2_EVICT_FIRST, L2_EVICT_LAST

    def policies(spec):
        ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
        # each TMA copy takes its policy from a 64-bit register set just before it
        values = dict(re.findall(r"mov\.b64\s+(%rd\d+),\s*(\d+);", ptx))
        loads = re.findall(r"cp\.async\.bulk\.tensor\.\w+\.shared::cta\.global\.[^\n]*,\s*(%rd\d+);", ptx)
        stores = re.findall(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared::cta\.[^\n]*,\s*(%rd\d+);", ptx)
        return [int(values.get(r, 0)) for r in loads], [int(values.get(r, 0)) for r in stores]

    monkeypatch.setattr(sm90, "_L2_HINTS_ENV", "")
    hd256 = _spec(256, True, 2048)
    assert FastSm90Forward.l2_hints(hd256)
    loads, stores = policies(hd256)
    assert loads.count(L2_EVICT_LAST) >= 2 and L2_EVICT_FIRST in loads, loads  # K, V; Q
    assert set(loads) == {L2_EVICT_FIRST, L2_EVICT_LAST} and set(stores) == {L2_EVICT_FIRST}, (loads, stores)
    hd128 = _spec(128, True, 1024)
    assert not FastSm90Forward.l2_hints(hd128)
    loads, stores = policies(hd128)
    assert not {L2_EVICT_FIRST, L2_EVICT_LAST} & set(loads + stores), (loads, stores)
    monkeypatch.setattr(sm90, "_L2_HINTS_ENV", "1")
    loads, stores = policies(hd128)
    assert set(loads) == {L2_EVICT_FIRST, L2_EVICT_LAST} and set(stores) == {L2_EVICT_FIRST}, (loads, stores)
