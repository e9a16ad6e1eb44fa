"""CPU-only tests of the Hopper forward kernel: compile for sm_90a without a GPU, check the PTX.

For every configuration the dispatcher can pick (head dim x causal x dtype) the kernel is traced
(with the trace-time pipeline / shared-memory checks on) and assembled for sm_90a; the PTX must
contain a loop whose body issues wgmma.mma_async, plus the TMA loads and the register
reallocation that the warp specialisation relies on.
"""
from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from dualattn.spec import AttentionSpec

cutlass = pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
import cutlass.cute as cute  # noqa: E402  (module level: the probes' annotations name it)
from cutlass import Int32  # noqa: E402

from dualattn.fast.common.sm90_pipeline import (  # noqa: E402
    PipelineConfigError, check_pipeline_config, check_smem_budget)
from dualattn.fast.common.tile_order import L2_SECTION_BYTES  # noqa: E402
from dualattn.fast.sm90 import FORWARD, SUPPORTED_HEAD_DIMS, FastSm90Forward  # noqa: E402


@pytest.fixture(autouse=True)
def _grid_rules_see_one_sm(monkeypatch):
    """The config's grid rules (sm90._model_sm_count: hd64's warpgroups by how the tiles fill the
    SMs) see one SM here, so this file's small specs get the configs large grids get;
    test_hd64_warpgroup_rules checks the rules on 132 SMs."""
    import dualattn.fast.sm90 as sm90
    monkeypatch.setattr(sm90, "_MODEL_SMS_ENV", "1")


def _spec(d=128, causal=False, dtype=torch.bfloat16, sq=1000, sk=1000, **kw):
    kw.setdefault("return_lse", True)  # the kernel that stores the LSE (the one every harness runs)
    return AttentionSpec("batched", 2, sq, sk, 8, 2, d, kw.pop("dv", d), dtype, "cuda", causal=causal, **kw)


def _loops_with(ptx: str, needle: str, without: str = "") -> int:
    """Number of backward branches whose loop body contains ``needle`` (and not ``without``)."""
    lines = ptx.splitlines()
    labels = {}
    found = 0
    for i, ln in enumerate(lines):
        m = re.match(r"^\s*(\$L__\w+):", ln)
        if m:
            labels[m.group(1)] = i
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = lines[labels[m.group(1)]:i]
            if any(needle in x for x in body) and not (without and any(without in x for x in body)):
                found += 1
    return found


CONFIGS = [(d, c, dt) for d in SUPPORTED_HEAD_DIMS for c in (False, True)
           for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d,causal,dtype", CONFIGS,
                         ids=[f"d{d}-{'causal' if c else 'full'}-{str(dt)[6:]}" for d, c, dt in CONFIGS])
def test_compiles_for_sm90a_with_wgmma_loop(d, causal, dtype):
    spec = _spec(d, causal, dtype)
    assert FastSm90Forward.can_implement_static(spec) is None
    compiled = FastSm90Forward().compile_only(spec, arch=90)
    ptx = compiled.__ptx__
    assert ptx and ".target sm_90a" in ptx
    ty = "bf16" if dtype == torch.bfloat16 else "f16"
    tile_n = FastSm90Forward.config(spec)[1]
    # S = Q K^T: m64 n<tile_n>; O += P V: m64 n<D> with P from registers
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_n}k16\.f32\.{ty}\.{ty}", ptx)
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{d}k16\.f32\.{ty}\.{ty}", ptx)
    # the main loop issues wgmma inside its body; causal has a second loop over the diagonal
    # blocks (non-causal masks at most one block, which the compiler turns into straight code)
    assert _loops_with(ptx, "wgmma.mma_async") >= (2 if causal else 1)
    assert _loops_with(ptx, "cp.async.bulk.tensor") >= 1   # producer's K/V TMA loop
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    # O's epilogue: with its own buffer (D <= 128), or one warpgroup's slot of it that the two
    # share by turns (hd256 at 64-key tiles, non-causal hd192 under 4k keys at 96-key tiles),
    # each warpgroup stages and stores its 64 rows
    # behind a barrier of its own 128 threads (ids 5..), or at hd64 each warp its 16 rows
    # behind warp syncs (FastSm90Forward.warp_store_o); O aliased with Q (causal hd192) waits
    # for all consumer warpgroups at barrier 1
    wgs = FastSm90Forward.config(spec)[0] // 64
    shared_slot = FastSm90Forward.shared_o_slot(spec)
    assert shared_slot is (d == 256 or (d == 192 and not causal))  # hd192: under 4k keys
    assert FastSm90Forward.wg_epilogue(spec) is (d <= 128 or shared_slot)
    assert FastSm90Forward.warp_store_o(spec) is (d == 64)
    if d == 64:
        assert "bar.warp.sync" in ptx and not re.search(r"bar\.sync\s+1,", ptx)
    elif d <= 128 or shared_slot:
        assert re.search(r"bar\.sync\s+%r\d+,\s*128;", ptx) and not re.search(r"bar\.sync\s+1,", ptx)
    else:
        assert re.search(r"bar\.sync\s+1,\s*%d;" % (128 * wgs), ptx)
    # the slot's hand-over between the two warpgroups (ids 8, 9): an arrive and a wait of 256
    # threads (ping-pong's ring has such arrives too); warpgroup 0's last wait (id 8)
    if not FastSm90Forward.config(spec)[3]:
        assert (re.search(r"bar\.arrive\s+%r\d+,\s*256;", ptx) is not None) is shared_slot
    assert (re.search(r"bar\.sync\s+8,\s*256;", ptx) is not None) is shared_slot


@pytest.mark.compile_only
def test_compile_key_is_explicit_and_shape_free(monkeypatch):
    import dualattn.fast.sm90 as sm90
    key = FORWARD.compile_key
    a, b = _spec(sq=100, sk=7000), _spec(sq=4096, sk=5000)
    assert key(a, 90) == key(b, 90)  # shapes never recompile
    short_a, short_b = _spec(sq=100, sk=33), _spec(sq=4096, sk=1900)  # under 2048 keys (D <= 128)
    assert key(short_a, 90) == key(short_b, 90)
    # ... except that keys too few to cut (stream-K) pick the kernel without that code (and with
    # the LSE stored after O, FastSm90Forward.lse_after_o, the last field)
    assert [i for i, (x, y) in enumerate(zip(key(a, 90), key(short_a, 90))) if x != y] == [16, 45]
    key = FORWARD.compile_key(_spec(192, True, torch.float16), 90)
    assert key == ("sm90_fwd", "torch.float16", 192, 192, True, False, False, False, 128, 112, 2, False, True, False,
                   False, False, False, False, True, True, False, 2, False, True, False, False, False, True, False,
                   True, 1, False, False, 8.0, False, L2_SECTION_BYTES, 1, True, "sm_90a", False, False, False, False, 1,
                   False, True)
    # (element masks from a bit set per row: FastSm90Forward.bit_mask, index 18; tile
    # coordinates from the producer: FastSm90Forward.tile_info, index 19; Q from registers:
    # FastSm90Forward.q_regs, index 20; warpgroups with no row in the sequence pass their
    # blocks, FastSm90Forward.pass_empty_wg, and non-causal query blocks turn by round,
    # .rotate_m_blocks: their sum, index 21; one O slot the warpgroups share,
    # FastSm90Forward.shared_o_slot, index 22; O's staging addresses computed per tile,
    # FastSm90Forward.staging_per_tile, index 23; a warpgroup's first key block on its lower
    # half only, FastSm90Forward.narrow_first, index 24: off at D > 128; the diagnostics' phase
    # trace, FastSm90Forward.trace_phases, index 25; the tiles' coordinates from a decoder warp,
    # FastSm90Forward.tile_decoder, index 26; O staged by stmatrix, FastSm90Forward.stmatrix_o,
    # index 27; each warp's 16 rows of O stored by the warp, FastSm90Forward.warp_store_o,
    # index 28: off here, where no warpgroup has its own epilogue; L2 eviction priorities on the
    # TMA copies, FastSm90Forward.l2_hints, index 29)
    # (each warpgroup's own key bound: on for causal hd192, FastSm90Forward.wg_key_bound)
    # the softmax's row max / sum in 4 partial chains at D = Dv = 128 (FastSm90Forward.reduce_chains)
    assert FORWARD.compile_key(_spec(128), 90)[-10] == 4 and FORWARD.compile_key(_spec(64), 90)[-10] == 1
    # stream-K merges move only the live rows (FastSm90Forward.merge_live_rows, the field before merge_batch):
    # where a tile has rows past the end and the units fit the SMs (split grids); the kernel
    # keeps it only where stream-K is compiled in; off by its knob
    monkeypatch.setattr(sm90, "_MODEL_SMS_ENV", "132")
    assert FORWARD.compile_key(_spec(128), 90)[-4] is True                # 2 x 8 heads x 8 tiles
    assert FORWARD.make_kernel(_spec(128, sk=8192)).merge_live_rows       # stream-K: kept
    assert not FORWARD.make_kernel(_spec(128, sq=100, sk=33)).merge_live_rows  # nothing to merge
    assert FORWARD.compile_key(_spec(128, sq=1024), 90)[-4] is False      # whole tiles
    assert FORWARD.compile_key(_spec(128, sq=3000), 90)[-4] is False      # more units than SMs
    monkeypatch.setattr(sm90, "_MERGE_LIVE_ROWS_ENV", "0")
    assert FORWARD.compile_key(_spec(128), 90)[-4] is False
    assert not FORWARD.make_kernel(_spec(128, sk=8192)).merge_live_rows
    monkeypatch.setattr(sm90, "_MERGE_LIVE_ROWS_ENV", "")
    # the records a merge of more than two pieces reads at a time (FastSm90Forward.merge_batch,
    # the field before end_aligned): 4 in stream-K configs of at most twice the SMs in units, else 1 (no
    # unrolled merge code where no call cuts more than two pieces); set by its knob
    assert FORWARD.compile_key(_spec(128, sk=8192), 90)[-3] == 4
    assert FORWARD.make_kernel(_spec(128, sk=8192)).merge_batch == 4
    assert FORWARD.make_kernel(_spec(128, sq=100, sk=33)).merge_batch == 1    # no stream-K
    assert FORWARD.compile_key(_spec(128, sq=4300, sk=8192), 90)[-3] == 1      # 544 units
    monkeypatch.setattr(sm90, "_MERGE_BATCH_ENV", "2")
    assert FORWARD.compile_key(_spec(128, sk=8192), 90)[-3] == 2
    monkeypatch.setattr(sm90, "_MERGE_BATCH_ENV", "")
    monkeypatch.setattr(sm90, "_MODEL_SMS_ENV", "1")
    # query tiles aligned to the sequence's end (FastSm90Forward.end_aligned, the second last field):
    # right-bounded batched calls on tiles taller than their key blocks whose length leaves a
    # whole 64-row slice over (the shift a run-time value: 900 and 1000 + 64 k share a kernel)
    assert FORWARD.compile_key(_spec(256, True, sq=900), 90)[-2] is FORWARD.compile_key(_spec(256, True, sq=1600), 90)[-2] is True
    assert FORWARD.row_shift(_spec(256, True, sq=900)) == 64 and FORWARD.row_shift(_spec(256, True, sq=1600)) == 64
    assert FORWARD.compile_key(_spec(256, True, sq=1000), 90)[-2] is False and FORWARD.row_shift(_spec(256, True, sq=1000)) == 0
    assert FORWARD.compile_key(_spec(256, True, sq=1024), 90)[-2] is False  # no rows left over
    assert FORWARD.compile_key(_spec(256, False, sq=900), 90)[-2] is False                  # no right bound
    assert FORWARD.compile_key(_spec(256, True, sq=900, window=(64, 0)), 90)[-2] is False   # a left bound too
    assert FORWARD.compile_key(_spec(128, True, sq=900), 90)[-2] is False                   # tile_m == tile_n
    assert FORWARD.compile_key(_spec(192, True, sq=900), 90)[-2] is False  # O by whole tiles (a TMA store can't start before row 0)
    varlen = AttentionSpec("varlen", 2, 900, 900, 8, 2, 256, 256, torch.bfloat16, "cuda", causal=True)
    assert FORWARD.compile_key(varlen, 90)[-2] is False
    monkeypatch.setattr(sm90, "_END_ALIGNED_ENV", "1")
    assert FORWARD.compile_key(_spec(128, True, sq=900), 90)[-2] is True
    assert FORWARD.compile_key(_spec(128, False, sq=900, window=(-1, 3)), 90)[-2] is True  # a right bound alone
    monkeypatch.setattr(sm90, "_END_ALIGNED_ENV", "0")
    assert FORWARD.compile_key(_spec(256, True, sq=900), 90)[-2] is False and FORWARD.row_shift(_spec(256, True, sq=900)) == 0
    monkeypatch.setattr(sm90, "_END_ALIGNED_ENV", "")
    # a tile's LSE stored after its O store is issued (FastSm90Forward.lse_after_o, the last
    # field): configs without stream-K code; either order by its knob
    monkeypatch.setattr(sm90, "_MODEL_SMS_ENV", "132")
    assert FORWARD.compile_key(_spec(128, sq=1024, sk=1024), 90)[-1] is True
    assert FORWARD.compile_key(_spec(64, True, sq=1024, sk=1024), 90)[-1] is True
    assert FORWARD.make_kernel(_spec(256, True, sq=1024, sk=1024)).lse_after_o
    assert FastSm90Forward.stream_k(_spec(128, sk=8192)) and FORWARD.compile_key(_spec(128, sk=8192), 90)[-1] is False
    monkeypatch.setattr(sm90, "_LSE_AFTER_O_ENV", "1")
    assert FORWARD.make_kernel(_spec(128, sk=8192)).lse_after_o
    monkeypatch.setattr(sm90, "_LSE_AFTER_O_ENV", "0")
    assert FORWARD.compile_key(_spec(128, sq=1024, sk=1024), 90)[-1] is False
    monkeypatch.setattr(sm90, "_LSE_AFTER_O_ENV", "")
    monkeypatch.setattr(sm90, "_MODEL_SMS_ENV", "1")
    # a light last 192-row tile split over the three warpgroups (FastSm90Forward.key_split, the
    # fifth last field): plain non-causal hd64, not causal, not a window, not 128-row tiles
    assert FORWARD.compile_key(_spec(64), 90)[-5] is True
    assert FORWARD.compile_key(_spec(64, True), 90)[-5] is False
    assert FORWARD.compile_key(_spec(64, window=(100, -1)), 90)[-5] is False
    assert FORWARD.compile_key(_spec(128), 90)[-5] is False
    # stream-K (cut tiles in the last rounds) is compiled in for non-causal calls with the keys
    assert FORWARD.compile_key(_spec(192, sk=8192), 90)[16] is True
    # the paired causal order is compiled in (persistent causal grids only)
    assert FORWARD.compile_key(_spec(64, True), 90)[-15] is True
    # the softmax's rescale threshold: on from Dv 192, off below (FastSm90Forward.rescale_threshold)
    assert FORWARD.compile_key(_spec(128), 90)[-13] == 0.0
    assert FORWARD.compile_key(_spec(causal=True), 90) != FORWARD.compile_key(_spec(), 90)
    # window sizes and the cap are runtime values; only whether each bound / softcap exists counts
    assert FORWARD.compile_key(_spec(window=(5, 0)), 90) == FORWARD.compile_key(_spec(window=(90, 3)), 90)
    assert FORWARD.compile_key(_spec(softcap=5.0), 90) == FORWARD.compile_key(_spec(softcap=30.0), 90)
    assert FORWARD.compile_key(_spec(window=(5, -1)), 90) != FORWARD.compile_key(_spec(window=(-1, 5)), 90)
    # windows with a left bound on the persistent grid run the window order instead of the pairs
    # from 4096 query rows (FastSm90Forward.window_order, the seventh last field); with a left
    # bound at D <= 128 the last key block may run on its upper half (FastSm90Forward.narrow_last,
    # the sixth last field)
    win = FORWARD.compile_key(_spec(window=(64, 0), causal=True, sq=4096, sk=4096), 90)
    assert win[-7] is True and win[-15] is False
    short = FORWARD.compile_key(_spec(window=(64, 0), causal=True, sq=4095, sk=4096), 90)
    assert short[-7] is False and short[-15] is True
    assert win[-6] is True and short[-6] is True
    assert FORWARD.compile_key(_spec(window=(-1, 5)), 90)[-6] is False  # no left bound
    assert FORWARD.compile_key(_spec(256, window=(64, 0)), 90)[-6] is False  # D > 128


MASK_CONFIGS = [dict(window=(64, 0)), dict(window=(-1, 32)), dict(window=(33, 7), causal=True),
                dict(softcap=20.0, causal=True),
                dict(window=(1024, 0), causal=True, sq=4096, sk=4096)]  # the window order


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kw", MASK_CONFIGS, ids=[str(sorted(k.items())) for k in MASK_CONFIGS])
def test_window_and_softcap_configs_compile(kw):
    spec = _spec(128, **kw)
    assert FastSm90Forward.can_implement_static(spec) is None
    assert FastSm90Forward.window_order(spec) == ("sq" in kw)
    ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
    assert _loops_with(ptx, "wgmma.mma_async") >= 1
    if "softcap" in kw:  # tanh (expanded into ex2 / rcp) is applied to every score
        plain = FastSm90Forward().compile_only(_spec(128, causal=kw.get("causal", False)), arch=90)
        assert ptx.count("ex2.approx") > plain.__ptx__.count("ex2.approx")


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_stream_k_merge_only_in_equal_work_configs(d):
    """Non-causal batched configs and the paired causal ones carry the stream-K merge (gpu-scope
    atomics on the counters, release / acquire around the workspace, gpu-scope fences) where
    their units have the keys to be cut; windowed configs (a sliding causal window too: short
    pairs of unequal work) and calls with too few keys carry none of it, and their argument
    schema has no stream-K fields. The paired ones take the length of a unit as well. hd256
    causal pairs only short calls (one CTA per tile from 4k): never enough keys to cut."""
    plain, causal = _spec(d, sq=4096, sk=4096), _spec(d, causal=True, sq=4096, sk=4096)
    window, sliding = _spec(d, window=(100, 100)), _spec(d, causal=True, window=(64, -1))
    # under the minimum keys a unit must visit to be cut: 4096, or 2048 for one tile at D <= 128
    short = _spec(d, sq=4096, sk=1900 if d <= 128 else 3000)
    short_causal = _spec(d, causal=True, sq=3000, sk=3000)
    if d <= 128:  # a single tile of 2k keys is cut there, a pair of causal tiles is not
        assert FastSm90Forward.stream_k(_spec(d, sq=4096, sk=2048))
    equal_work = (plain, causal) if d < 256 else (plain,)
    assert FastSm90Forward.paired(_spec(d, True)) and (d == 256 or FastSm90Forward.paired(causal))
    for spec in equal_work:
        assert FastSm90Forward.stream_k(spec)
        ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
        atoms = [ln.strip() for ln in ptx.splitlines() if "atom." in ln]
        # (atom's default scope is .gpu)
        assert any(".release." in a and ".add." in a for a in atoms), atoms
        assert any(".acquire." in a for a in atoms) and "fence.acq_rel.gpu" in ptx, atoms
        assert "sk_workspace" in FastSm90Forward.arg_schema(spec).names
    if d < 256:
        assert "sk_unit_blocks" in FastSm90Forward.arg_schema(causal).names
    else:
        assert not any(FastSm90Forward.stream_k(_spec(d, True, sq=n, sk=n)) for n in (1000, 2048, 4096, 16384))
    assert "sk_unit_blocks" not in FastSm90Forward.arg_schema(plain).names
    for other in (short, short_causal, _spec(d, True)):
        assert not FastSm90Forward.stream_k(other)
        assert "sk_workspace" not in FastSm90Forward.arg_schema(other).names
    for other in (window, sliding):
        assert not FastSm90Forward.stream_k(other)
        assert "atom." not in FastSm90Forward().compile_only(other, arch=90).__ptx__
        assert "sk_workspace" not in FastSm90Forward.arg_schema(other).names


@pytest.mark.parametrize("kw,word", [
    (dict(needs_grad=True), "backward"),
    (dict(num_key_ranges=5), "key ranges"),
    (dict(block_size=(64, 128)), "block_m"),
    (dict(block_size=(128, 72)), "block_n"),
    (dict(d=80), "head dim"),
    (dict(dtype=torch.float32), "dtype"),
    (dict(dv=64), "head dims"),
])
def test_refuses_with_reason(kw, word):
    kw = dict(kw)
    spec = _spec(kw.pop("d", 128), dtype=kw.pop("dtype", torch.bfloat16), **kw)
    reason = FastSm90Forward.can_implement_static(spec)
    assert reason and word in reason


def test_refuses_without_sm90_gpu():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this machine has an sm_90 GPU")
    assert "sm_90" in FORWARD.can_implement(_spec())


def test_trace_time_checks_catch_bad_configs():
    check_pipeline_config("K", 128 * 128 * 2, (128, 128), 16, 2, 1, 8)
    with pytest.raises(PipelineConfigError, match="transaction bytes"):
        check_pipeline_config("K", 128 * 128, (128, 128), 16, 2, 1, 8)
    with pytest.raises(PipelineConfigError, match="arrive count"):
        check_pipeline_config("K", 128 * 128 * 2, (128, 128), 16, 2, 1, 0)
    with pytest.raises(PipelineConfigError, match="box"):
        check_pipeline_config("K", 512 * 64 * 2, (512, 64), 16, 2, 1, 8)
    with pytest.raises(PipelineConfigError, match="shared memory"):
        check_smem_budget({"Q": 64 << 10, "K": 96 << 10, "V": 96 << 10}, 10, "sm_90a")
    # the kernel constructor runs the budget check: hd256 with 3 stages of 80-wide K/V cannot fit
    from dualattn.fast.sm90.flash_fwd import FlashFwdSm90
    with pytest.raises(PipelineConfigError):
        FlashFwdSm90(cutlass.BFloat16, 256, 256, False, 80, 3)


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_tile_override_without_intra_warpgroup_overlap_compiles(monkeypatch):
    """The tuning override's sixth field turns the intra-warpgroup overlap off (one_block: Q K^T,
    wait, softmax, P V, wait), which no default config uses; the features that need the overlap
    turn off with it, and the 3-warpgroup hd128 build (docs section 39) traces and assembles."""
    monkeypatch.setenv("DUALATTN_SM90_TILES", "128:128,2,1,1,3,0")
    spec = _spec(128, False)
    assert FastSm90Forward.config(spec)[:5] == (192, 128, 2, True, False)
    assert not (FastSm90Forward.narrow_first(replace(spec, causal=True))
                or FastSm90Forward.rescale_before_pv(spec) or FastSm90Forward.pass_empty_wg(spec))
    ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
    assert _loops_with(ptx, "wgmma.mma_async") >= 1
    # without the overlap every wgmma group is waited for in full before the next is issued
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert waits and set(waits) == {"0"}
    monkeypatch.delenv("DUALATTN_SM90_TILES")
    assert FastSm90Forward.config(spec)[4]


def test_register_split_is_paid_for_by_the_producer(monkeypatch):
    """setmaxnreg.inc waits until the CTA's pool has the registers: the consumers' increase over
    the launch allocation must be covered by what the producer warpgroup gives back, or the
    kernel hangs (a 4-warpgroup build at 96 -> 24 / 120 did, on an H100). Every split in use
    passes; that split is refused at trace time, though its registers fit in the 64K file
    (120 x 512 + 24 x 128 = 64512), which is all the check before it asked."""
    from dualattn.fast.sm90.flash_fwd import FlashFwdSm90
    for wgs in FlashFwdSm90.REGS:
        FlashFwdSm90(cutlass.BFloat16, 64, 64, False, 128, 2, num_mma_wg=wgs)
    assert [FlashFwdSm90.launch_registers(128 * n) for n in (3, 4, 5)] == [168, 128, 96]
    monkeypatch.setitem(FlashFwdSm90.REGS, 4, (24, 120))
    with pytest.raises(AssertionError, match=r"\(120, 24, 96\)"):
        FlashFwdSm90(cutlass.BFloat16, 64, 64, False, 64, 2, num_mma_wg=4)


# ---- cached-call fast path: packed arguments (pointers + shapes + strides in one struct) ----

def test_packed_args_roundtrip_on_host():
    """A host-only jit function reads every field kind back from the packed struct (runs on the
    CPU: no kernel), so the packing protocol itself is checked end to end."""
    import cutlass.cute as cute
    from cutlass import Float32
    from dualattn.fast.common.launch_args import ArgSchema

    sch = ArgSchema([("out", ("ptr", cutlass.Float32, 4)), ("a", "i32"), ("b", "i64"),
                     ("c", "f32"), ("d", "i32")])

    @cute.jit
    def probe(args):
        out_ptr, a, b, c, d = args.values
        t = cute.make_tensor(out_ptr, cute.make_layout(4))
        t[0] = Float32(a)
        t[1] = Float32(b // 1024)
        t[2] = c
        t[3] = Float32(d)

    fn = cute.compile(probe, sch.fake())
    buf = torch.zeros(4, dtype=torch.float32)
    fn(sch.pack(buf.data_ptr(), -5, 1 << 40, 2.5, 123456))
    assert buf.tolist() == [-5.0, 2.0 ** 30, 2.5, 123456.0]
    with pytest.raises(ValueError, match="duplicate"):
        ArgSchema([("a", "i32"), ("a", "i64")])


@pytest.mark.compile_only
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (7, 3), 5.0)])
def test_sm90_packed_args_build_the_right_tensors(causal, window, softcap, monkeypatch):
    """The kernel's host entry builds Q, K, V (strided views), O and LSE from the packed
    argument: a host-only probe using the same builder (FlashFwdSm90.tensors_from_pointers)
    reads Q/K/V elements and writes O/LSE elements of CPU tensors at the far corners, and
    returns the scalars, so pointer, shape, stride and scalar wiring are checked on the CPU.
    (GQA packing off: its views have a test of their own below.)"""
    import dualattn.fast.sm90 as sm90
    monkeypatch.setattr(sm90, "_PACK_GQA_ENV", "0")
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    B, Sq, Sk, Hq, Hkv, D = 2, 37, 53, 6, 2, 64
    spec = _spec(D, causal, sq=Sq, sk=Sk, window=window, softcap=softcap)
    fwd = FastSm90Forward()
    kern = fwd.make_kernel(spec)
    sch = fwd.arg_schema(spec)

    @cute.jit
    def probe(args, res_ptr):
        vals = args.values
        mQ, mK, mV, mO, mLSE = kern.tensors_from_pointers(*vals[:19])
        r = cute.make_tensor(res_ptr, cute.make_layout(16))
        r[0] = Float32(mQ[B - 1, Sq - 1, Hq - 1, D - 1])
        r[1] = Float32(mQ[1, 2, 3, 4])
        r[2] = Float32(mK[B - 1, Sk - 1, Hkv - 1, D - 1])
        r[3] = Float32(mV[B - 1, Sk - 1, Hkv - 1, D - 1])
        r[4] = Float32(mV[0, 5, 1, 7])
        mO[B - 1, Sq - 1, Hq - 1, D - 1] = mO.element_type(3.0)
        mO[1, 2, 3, 4] = mO.element_type(5.0)
        mLSE[B - 1, Hq - 1, Sq - 1] = Float32(7.0)
        mLSE[1, 2, 3] = Float32(9.0)
        for i in cutlass.range_constexpr(6):
            r[5 + i] = Float32(vals[19 + i])
        r[11] = Float32(cute.size(mQ.shape[1]))
        r[12] = Float32(cute.size(mK.shape[1]))

    fn = cute.compile(probe, sch.fake(), make_ptr(cutlass.Float32, 0, AddressSpace.gmem, 4))
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    # q, k, v as strided views of larger buffers (like a packed qkv projection)
    q = torch.randn(B, Sq, Hq + 2, D, generator=g).to(dt)[:, :, 1:Hq + 1]
    kv = torch.randn(B, Sk, 2, Hkv, D, generator=g).to(dt)
    k, v = kv[:, :, 0], kv[:, :, 1]
    out = torch.zeros(B, Sq, Hq, D, dtype=dt)
    lse = torch.zeros(B, Hq, Sq)
    res = torch.zeros(16)
    tail = fwd.scalar_fields(spec, 132)
    sk = fwd.no_cut_fields(spec)  # stream-K fields: no tile cut
    fn(fwd.pack_args(sch.pack, tail, q, k, v, out, lse, sk),
       make_ptr(cutlass.Float32, res.data_ptr(), AddressSpace.gmem, 4))
    exp = [q[-1, -1, -1, -1], q[1, 2, 3, 4], k[-1, -1, -1, -1], v[-1, -1, -1, -1], v[0, 5, 1, 7]]
    assert res[:5].tolist() == [float(x) for x in exp]
    assert res[5:11].tolist() == pytest.approx(list(tail))
    assert res[11:13].tolist() == [Sq, Sk]
    assert out[-1, -1, -1, -1] == 3.0 and out[1, 2, 3, 4] == 5.0 and out.count_nonzero() == 2
    assert lse[-1, -1, -1] == 7.0 and lse[1, 2, 3] == 9.0 and lse.count_nonzero() == 2


# ---- varlen (cu_seqlens) ----

VARLEN_CONFIGS = [(128, 128, False), (64, 64, True), (256, 256, True), (96, 96, False),
                  (192, 192, True), (192, 128, False)]


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d,dv,causal", VARLEN_CONFIGS,
                         ids=[f"d{d}-dv{dv}-{c}" for d, dv, c in VARLEN_CONFIGS])
def test_varlen_compiles_with_masked_store(d, dv, causal):
    spec = AttentionSpec("varlen", 3, 300, 500, 8, 2, d, dv, torch.bfloat16, "cuda", causal=causal, return_lse=True)
    assert FastSm90Forward.can_implement_static(spec) is None
    assert FORWARD.compile_key(spec, 90)[0] == "sm90_fwd_varlen"
    # causal varlen tiles run heaviest first within L2 sections of (sequence, head) pairs (GQA and
    # short sequences: not in pairs, see test_varlen_paired_order_compiles)
    assert FORWARD.compile_key(spec, 90)[-14] is causal and not FastSm90Forward.paired(spec)
    ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
    assert _loops_with(ptx, "wgmma.mma_async") >= (2 if causal else 1)
    assert _loops_with(ptx, "cp.async.bulk.tensor") >= 1   # K/V loads stay TMA
    # O of a tile inside its sequence leaves by TMA store; a sequence's last, partial tile through
    # row-predicated 16-byte st.global from shared memory (a TMA store would cross the sequence's
    # end): 128 rows x dv / 8 vectors, exactly split over 256 threads, or at D <= 128 (one
    # epilogue per warpgroup) each warpgroup's 64 rows over its 128 threads: as many stores per
    # thread (at dv 96 / 192 the old layout issued 7 / 13 stores, the extra ones past row 127)
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)
    assert (128 * dv // 8) % 256 == 0
    assert ptx.count("st.global.v4") == (128 * dv // 8) // 256


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_paired_order_compiles(d):
    """Varlen causal calls of few, long sequences (GQA or not) run pairs of equal work within each
    sequence: each tile's sequence comes from a warp scan of cu_seqlens (shuffles and a ballot in
    the producer's and the consumers' tile loops and slot bounds); short sequences and many
    sequences keep heaviest first in L2 sections (fast/sm90._paired_varlen)."""
    from dualattn.fast.sm90 import PAIRED_VARLEN_MAX_SEQUENCES, PAIRED_VARLEN_MIN_SEQLEN

    long_seq = PAIRED_VARLEN_MIN_SEQLEN[d]
    spec = AttentionSpec("varlen", 10, long_seq, long_seq, 8, 8, d, d, torch.bfloat16, "cuda", causal=True,
                         return_lse=True)
    assert FastSm90Forward.paired(spec) and FORWARD.compile_key(spec, 90)[-15] is True
    assert FastSm90Forward.paired(replace(spec, num_heads_kv=2))
    for other in (replace(spec, seqlen_q=long_seq - 1),
                  replace(spec, batch=PAIRED_VARLEN_MAX_SEQUENCES + 1), replace(spec, causal=False)):
        assert not FastSm90Forward.paired(other)
    ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
    # a 5-step inclusive scan in each tile loop: the producer's, and the consumers' too unless
    # the producer hands them each tile's coordinates (FastSm90Forward.tile_info); and one at the
    # kernel's start that counts the units for the slot bounds and checks the launch's unit
    # table against them (FlashFwdSm90.count_units)
    scans = (1 if FastSm90Forward.tile_info(spec) else 2) + 1
    assert ptx.count("shfl.sync.up") == scans * 5
    assert ptx.count("vote.sync.ballot") == scans
    assert _loops_with(ptx, "wgmma.mma_async") >= 2



def test_varlen_unit_table_fields_and_plan():
    """Varlen paired launches pass a unit table and its rounds after the SM count
    (FastSm90Forward.varlen_unit_table); the host deals the bench's documents by LPT (8 rounds of
    132 CTAs) and keeps the static stride where every unit weighs the same or the lengths are
    not on the host (value checks off: no synchronisation of its own)."""
    from dualattn.bench import doc_lengths

    lengths = doc_lengths(16384, 10)
    spec = AttentionSpec("varlen", 10, max(lengths), max(lengths), 16, 16, 128, 128, torch.bfloat16, "cuda",
                         causal=True)
    assert FastSm90Forward.paired(spec)
    names = FastSm90Forward.arg_schema(spec).names
    assert names.index("varlen_unit_table") == names.index("num_sms") + 1
    assert names.index("varlen_unit_rounds") == names.index("num_sms") + 2
    assert names.index("varlen_unit_count") == names.index("num_sms") + 3
    assert "varlen_unit_table" in FastSm90Forward.arg_schema(replace(spec, num_heads_kv=4)).names
    assert "varlen_unit_table" not in FastSm90Forward.arg_schema(replace(spec, causal=False)).names
    # the launch passes the table's fields where the schema has them (_forward_varlen): exactly
    # the paired calls
    for other in (spec, replace(spec, num_heads_kv=4), replace(spec, causal=False), replace(spec, seqlen_q=700),
                  replace(spec, batch=65), replace(spec, head_dim=64, head_dim_v=64), replace(spec, window=(300, 0))):
        schema = FastSm90Forward.arg_schema(other)
        assert ("varlen_unit_table" in schema.ptr_info) == FastSm90Forward.paired(other), other
    cu = tuple(sum(lengths[:i]) for i in range(11))
    rounds, table = FastSm90Forward.varlen_unit_plan(spec, cu, cu, 132)
    assert rounds == 8 and len(table) == 8 * 132 and max(table) == len([u for u in table if u >= 0]) - 1
    # the launch passes max(table) + 1 as the units planned for; the kernel's count_units
    # counts paired_units(query blocks, heads_q) over cu_seqlens and runs the static stride on
    # any other figure, so the two must agree or the table would never run
    from dualattn.fast.common.tile_order import paired_units
    tile_m = FastSm90Forward.config(spec)[0]
    assert max(table) + 1 == sum(paired_units(-(-n // tile_m), spec.num_heads_q) for n in lengths)
    # 14 documents in 16k: LPT's greedy deal models 1.006x the static stride's busiest CTA
    docs14 = doc_lengths(16384, 14)
    cu14 = tuple(sum(docs14[:i]) for i in range(15))
    assert FastSm90Forward.varlen_unit_plan(replace(spec, batch=14, seqlen_q=max(docs14), seqlen_k=max(docs14)),
                                            cu14, cu14, 132) == (0, [])
    even = tuple(1024 * i for i in range(17))
    assert FastSm90Forward.varlen_unit_plan(replace(spec, batch=16, seqlen_q=1024, seqlen_k=1024),
                                            even, even, 132) == (0, [])
    # past VARLEN_LPT_MAX_UNITS the host does not plan (its time grows with the units)
    from dualattn.fast.sm90 import VARLEN_LPT_MAX_UNITS
    long_docs = [8 * 128 * VARLEN_LPT_MAX_UNITS // 16 // 10 + 7 * i for i in range(10)]
    cu_long = tuple(sum(long_docs[:i]) for i in range(11))
    assert FastSm90Forward.varlen_unit_plan(replace(spec, seqlen_q=max(long_docs), seqlen_k=max(long_docs)),
                                            cu_long, cu_long, 132) == (0, [])
    unseen = torch.tensor(cu, dtype=torch.int32)
    assert FastSm90Forward.varlen_unit_table(spec, unseen, unseen, torch.device("cpu"), 132) == (0, 0, 0)


def test_block_sparse_unit_table_fields_and_plan(monkeypatch):
    """Block-sparse calls on the persistent grid pass a unit table and its rounds after the SM
    count (FastSm90Forward.csr_table / csr_unit_table). The bench's 25 % pattern (8k, 16 heads,
    132 SMs) is dealt in 16 rounds, L2 section by section, every unit once, and the busiest CTA
    models 0.93 or less of the kernel's own order's; a pattern of equal rows keeps the kernel's
    order (nothing to gain), and so does a CSR whose row pointers the value checks never read."""
    import dualattn.fast.sm90 as sm90
    from dualattn.bench import Cell, sparse_states
    from dualattn.fast.common.tile_order import static_stride_loads
    from dualattn.sparse import BlockSparse

    spec = AttentionSpec("batched", 2, 8192, 8192, 16, 16, 128, 128, torch.bfloat16, "cuda",
                         block_size=(128, 128))
    assert FastSm90Forward.csr_table(spec) and FastSm90Forward.csr_table(replace(spec, causal=True))
    names = FastSm90Forward.arg_schema(spec).names
    assert names.index("csr_unit_table") == names.index("num_sms") + 1
    assert names.index("csr_unit_rounds") == names.index("num_sms") + 2
    # not where the grid is one CTA per tile (hd256), with key ranges, varlen, or the knob off
    for other in (replace(spec, head_dim=256, head_dim_v=256), replace(spec, num_key_ranges=1),
                  replace(spec, mode="varlen"), replace(spec, block_size=None)):
        assert not FastSm90Forward.csr_table(other), other
        assert "csr_unit_table" not in FastSm90Forward.arg_schema(other).names
    monkeypatch.setattr(sm90, "_CSR_LPT_ENV", "0")
    assert not FastSm90Forward.csr_table(spec)
    monkeypatch.setattr(sm90, "_CSR_LPT_ENV", "")

    cell = Cell("fwd", "sparse", 2, 8192, 8192, 16, 16, 128, False, density=0.25, dtype=torch.bfloat16)
    bs = BlockSparse.from_block_states(sparse_states(cell), 128, 128, 8192, 8192)
    full, mask = (tuple(c.rowptr.flatten().tolist()) for c in (bs.q2k_full, bs.q2k_mask))
    rounds, table = FastSm90Forward.csr_unit_plan(spec, full, mask, (1, 1), 128, 128, 132)
    assert rounds == 16 and len(table) == 16 * 132
    assert sorted(u for u in table if u >= 0) == list(range(32 * 64))
    counts = [full[m + 1] - full[m] + mask[m + 1] - mask[m] for m in range(64)]
    costs = [counts[u % 64] + sm90.CSR_LPT_TILE_OVERHEAD for u in range(32 * 64)]
    loads = [sum(costs[table[k * 132 + c]] for k in range(16) if table[k * 132 + c] >= 0) for c in range(132)]
    assert max(loads) <= 0.93 * max(static_stride_loads(costs, 132))
    # sections of 2 heads (4 MB of K and V a head at 8k, CSR_LPT_SECTION_BYTES 8 MB): a CTA's
    # units come section by section
    for c in range(132):
        secs = [table[k * 132 + c] // 64 // 2 for k in range(16) if table[k * 132 + c] >= 0]
        assert secs == sorted(secs)
    # every row the same: the kernel's order is as good
    even = tuple(range(0, 65 * 16, 16))
    assert FastSm90Forward.csr_unit_plan(spec, even, tuple([0] * 65), (1, 1), 128, 128, 132) == (0, [])
    # per-head row pointers (B', H' = B, H), CSR blocks of 256 x 256 (two tiles a row, each CSR
    # block two key blocks): row r of head bh lists bh % 5 + r % 3 full blocks and one masked
    per_head, per_head_mask = [], []
    for bh in range(32):
        per_head += [sum(bh % 5 + r % 3 for r in range(n)) for n in range(33)]
        per_head_mask += list(range(33))
    wide = replace(spec, block_size=(256, 256))
    costs = FastSm90Forward.csr_unit_costs(wide, per_head, per_head_mask, (2, 16), 256, 256)
    assert costs == [2 * (bh % 5 + m // 2 % 3 + 1) + sm90.CSR_LPT_TILE_OVERHEAD for bh in range(32) for m in range(64)]
    # a batch-shared pattern (B' = 1, H' = heads) repeats per batch
    shared = FastSm90Forward.csr_unit_costs(wide, per_head[:33 * 16], per_head_mask[:33 * 16], (1, 16), 256, 256)
    assert shared == costs[:16 * 64] * 2
    rounds, table = FastSm90Forward.csr_unit_plan(wide, tuple(per_head), tuple(per_head_mask), (2, 16), 256, 256, 132)
    assert rounds and sorted(u for u in table if u >= 0) == list(range(32 * 64))
    # the launch's path: host copies kept by the value checks, then one plan per pattern
    dev = torch.device("cpu")
    assert FastSm90Forward.csr_unit_table(spec, bs, dev, 132) == (0, 0)  # never checked: no copy
    bs.check_compatible(2, 16, 8192, 8192, validate_values=True, exact_lengths=True)
    ptr, rounds = FastSm90Forward.csr_unit_table(spec, bs, dev, 132)
    assert ptr and rounds == 16 and FastSm90Forward.csr_unit_table(spec, bs, dev, 132) == (ptr, rounds)


@pytest.mark.parametrize("width", [16])
def test_varlen_o_store_threads_tile_exactly(width):
    """The (rows, threads per row) split of the varlen O store tiles 128 x Dv exactly."""
    from dualattn.fast.sm90.flash_fwd import o_store_threads
    vec = 128 // width
    for dv in range(16, 513, 16):
        rows, tpr = o_store_threads(dv, width)
        assert rows * tpr == 256 and 128 % rows == 0 and dv % (tpr * vec) == 0
        assert (128 // rows) * (dv // (tpr * vec)) * 256 * vec == 128 * dv  # every element once
    # the head dims whose old split (Dv / 8 threads per row) did not divide 128 rows
    assert o_store_threads(96, width) == (64, 4) and o_store_threads(192, width) == (32, 8)
    # power-of-two head dims keep one thread per vector of a row (the mapping GPU-tested before)
    for dv in (64, 128, 256):
        assert o_store_threads(dv, width) == (256 * vec // dv, dv // vec)


_O_STORE_MAPS = {}


def _o_store_map(dv, per_wg=False):
    """The kernel's own varlen O-store tiled copy evaluated at trace time for all 256 consumer
    threads (per_wg: one warpgroup's 128, over its 64 rows): {thread: {(m, k): [(row, col) of the
    vector's elements]}} with (m, k) the (row step, column step) modes that copy_rows indexes,
    its row predicate read at [0, m, 0]."""
    import cutlass.cute as cute
    from dualattn.fast.sm90.flash_fwd import FlashFwdSm90
    kern = FlashFwdSm90(cutlass.BFloat16, dv, dv, False, 64, 2, varlen=True)

    rows, nthreads = (64, 128) if per_wg else (kern.tile_m, 256)

    @cute.jit
    def trace():
        tiled = kern.o_store_tiled_copy(per_wg)
        out = {}
        for t in cutlass.range_constexpr(nthreads):
            tOcO = tiled.get_slice(t).partition_S(cute.make_identity_tensor((rows, dv)))
            steps = {}
            for m in cutlass.range_constexpr(cute.size(tOcO, mode=[1])):
                for k in cutlass.range_constexpr(cute.size(tOcO, mode=[2])):
                    elems = []
                    for e in cutlass.range_constexpr(cute.size(tOcO, mode=[0])):
                        elems.append(tOcO[e, m, k])
                    steps[(m, k)] = elems
            out[t] = steps
        _O_STORE_MAPS[dv, per_wg] = (out, cute.size(tiled))

    cute.compile(trace, options="--gpu-arch sm_90a")
    return _O_STORE_MAPS[dv, per_wg]


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dv,per_wg", [(96, False), (192, False), (64, False), (128, False),
                                       (256, False), (64, True), (96, True), (128, True)])
def test_varlen_o_store_writes_each_element_of_the_tile_once(dv, per_wg):
    """CPU model of the varlen epilogue's thread -> (row, vector) mapping, from the kernel's own
    tiled copy: every element of the 128 x Dv tile (per_wg: one warpgroup's 64 x Dv slice, by its
    128 threads) is written by exactly one (thread, step), as one 16-byte vector of 8 consecutive
    columns, and no row past the tile is touched (the H100 failures at Dv 96 / 192: rows 128.. of
    a sequence, the next query tile's, overwritten with shared memory from past O's tile by the
    CTA of the tile before)."""
    threads, nthr = _o_store_map(dv, per_wg)
    rows, nthreads = (64, 128) if per_wg else (128, 256)
    assert nthr == nthreads
    seen = {}
    for t, steps in threads.items():
        assert len(steps) == rows * dv // 8 // nthreads  # as many vectors per thread: none idle
        for (m, k), elems in steps.items():
            r0, c0 = elems[0]
            assert len(elems) == 8 and c0 % 8 == 0
            assert elems == [(r0, c0 + e) for e in range(8)], (t, m, k, elems)
            # store_O_rows predicates step m on row tOcO[0, m, 0]: the same row for every k
            assert steps[(m, 0)][0][0] == r0
            assert 0 <= r0 < rows and c0 + 8 <= dv, (t, m, k, r0, c0)
            assert (r0, c0) not in seen, f"({r0}, {c0}) written by threads {seen[(r0, c0)]} and {t}"
            seen[(r0, c0)] = t
    assert len(seen) == rows * dv // 8


def test_varlen_refusals_and_kvcache():
    spec = AttentionSpec("kvcache", 1, 1, 64, 4, 4, 128, 128, torch.bfloat16, "cuda")
    assert "kvcache" in FastSm90Forward.can_implement_static(spec)
    # every head-dim pair the kernel has is served varlen (96 / 192 since the O-store fix)
    for d, dv in ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)):
        spec = AttentionSpec("varlen", 3, 300, 500, 8, 2, d, dv, torch.bfloat16, "cuda")
        assert FastSm90Forward.can_implement_static(spec) is None


# ---- key ranges and block-sparse ----

FEATURE_CONFIGS = [
    ("batched", 128, True, dict(num_key_ranges=1)),
    ("batched", 64, False, dict(num_key_ranges=4, window=(100, 20))),
    ("batched", 256, False, dict(num_key_ranges=2, softcap=10.0)),
    ("varlen", 128, False, dict(num_key_ranges=2)),
    ("batched", 128, False, dict(block_size=(128, 128))),
    ("batched", 192, True, dict(block_size=(128, 128))),
    ("batched", 256, False, dict(block_size=(256, 128), num_key_ranges=1)),
    ("batched", 96, False, dict(block_size=(128, 64))),
    ("varlen", 128, False, dict(block_size=(128, 64))),
    # block-sparse with causal / a window (full entries skip the predicate, mask entries apply it)
    ("batched", 64, True, dict(block_size=(128, 256))),
    ("batched", 128, True, dict(block_size=(128, 128), window=(200, 0))),
    ("varlen", 256, True, dict(block_size=(128, 128))),
]


def _feature_spec(mode, d, causal, kw):
    return AttentionSpec(mode, 2, 1000, 1000, 8, 2, d, d, torch.bfloat16, "cuda", causal=causal,
                         **kw)


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,d,causal,kw", FEATURE_CONFIGS,
                         ids=[f"{m}-d{d}-{c}-{sorted(k.items())}" for m, d, c, k in FEATURE_CONFIGS])
def test_key_range_and_block_sparse_configs_compile(mode, d, causal, kw):
    spec = _feature_spec(mode, d, causal, kw)
    assert FastSm90Forward.can_implement_static(spec) is None
    key = FORWARD.compile_key(spec, 90)
    assert ("_kr" in key[0]) == ("num_key_ranges" in kw) and ("_bs" in key[0]) == ("block_size" in kw)
    tile_n = FastSm90Forward.config(spec)[1]
    if "block_size" in kw:  # the key tile divides the CSR's key block
        assert kw["block_size"][1] % tile_n == 0 and kw["block_size"][0] % 128 == 0
    ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_n}k16", ptx)
    assert _loops_with(ptx, "wgmma.mma_async") >= 1
    assert _loops_with(ptx, "cp.async.bulk.tensor") >= 1
    # the plan (key-range spans / CSR rows) and the per-thread intervals are read from global
    # memory (the dense batched kernel reads nothing but TMA tiles: no ld.global at all)
    assert "ld.global" in ptx


def test_block_sparse_tile_choice():
    from dualattn.fast.sm90 import TILE_CONFIG, _sparse_tile_n
    assert _sparse_tile_n(128, 128) == 128 and _sparse_tile_n(128, 64) == 64
    assert _sparse_tile_n(256, 128) == 64 and _sparse_tile_n(192, 128) == 64
    assert _sparse_tile_n(256, 80) == 80 and _sparse_tile_n(64, 72) is None
    for d in SUPPORTED_HEAD_DIMS:  # never larger than the dense tile (shared-memory budget)
        assert all(_sparse_tile_n(d, bn) <= TILE_CONFIG[d][0] for bn in (16, 64, 128, 256, 512))


def test_dense_compile_key_unchanged_by_features():
    base = FORWARD.compile_key(_spec(), 90)
    assert base[0] == "sm90_fwd"
    assert FORWARD.compile_key(_spec(num_key_ranges=2), 90)[0] == "sm90_fwd_kr2"
    assert FORWARD.compile_key(_spec(num_key_ranges=2), 90) != FORWARD.compile_key(_spec(num_key_ranges=3), 90)
    # a CSR on the persistent grid takes its tiles from the launch's table (csr_table), one
    # per tile does not (hd256)
    assert FORWARD.compile_key(_spec(block_size=(128, 128)), 90)[0] == "sm90_fwd_bs_table"
    assert FORWARD.compile_key(_spec(256, block_size=(128, 128)), 90)[0] == "sm90_fwd_bs"


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,causal", [("batched", True), ("batched", False)])
def test_head_dims_192_128_compile(mode, causal):
    spec = AttentionSpec(mode, 2, 1000, 1000, 8, 2, 192, 128, torch.bfloat16, "cuda", causal=causal)
    assert FastSm90Forward.can_implement_static(spec) is None
    assert FORWARD.compile_key(spec, 90)[2:4] == (192, 128)
    ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
    # S = Q K^T and O += P V are both m64n128 (tile_n 128, Dv 128); K = 192 is 12 k16 steps
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16", ptx)
    assert not re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n192k16", ptx)
    assert _loops_with(ptx, "wgmma.mma_async") >= 1


def test_prep_gives_tma_aligned_bases():
    # a contiguous view at an odd element offset is contiguous() already: it must be cloned, or
    # the TMA descriptor (built without validation) rounds its base down and reads rows shifted
    from dualattn.fast.sm90 import FastSm90Forward
    buf = torch.randn(2 * 128 * 4 * 64 + 1, dtype=torch.bfloat16)
    q = buf[1:].view(2, 128, 4, 64)
    assert q.is_contiguous() and q.data_ptr() % 16
    got = FastSm90Forward._prep(q)
    assert got.data_ptr() % 16 == 0 and torch.equal(got, q)
    aligned = torch.randn(2, 128, 4, 64, dtype=torch.bfloat16)
    assert FastSm90Forward._prep(aligned) is aligned
    wide = torch.randn(2, 128, 4, 128, dtype=torch.bfloat16)[..., :64]  # strides multiples of 8
    assert FastSm90Forward._prep(wide) is wide
    expanded = torch.randn(2, 128, 1, 64, dtype=torch.bfloat16).expand(2, 128, 4, 64)  # head stride 0
    got = FastSm90Forward._prep(expanded)
    assert got.stride(2) == 64 and torch.equal(got, expanded)


def _global_stores(ptx: str) -> int:
    return len(re.findall(r"\bst\.global\.", ptx))


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_call_without_lse_compiles_a_kernel_that_does_not_store_it():
    """return_lse=False without grad: its own compile key, and the PTX loses the LSE store (the
    only plain global store of the forward, 32-bit: O leaves through TMA). A sliding causal
    window: plain and causal kernels also store the stream-K merge's workspace
    (test_stream_k_merge_only_...)."""
    win = (256, -1)
    with_lse, without = _spec(return_lse=True, causal=True, window=win), _spec(return_lse=False, causal=True, window=win)
    assert FORWARD.compile_key(with_lse, 90) != FORWARD.compile_key(without, 90)
    assert (FORWARD.compile_key(_spec(return_lse=False, needs_grad=True, causal=True, window=win), 90)
            == FORWARD.compile_key(with_lse, 90))
    ptx_with = FastSm90Forward().compile_only(with_lse, arch=90).__ptx__
    ptx_without = FastSm90Forward().compile_only(without, arch=90).__ptx__
    assert _global_stores(ptx_with) >= 1
    assert _global_stores(ptx_without) == 0


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_hd64_warpgroup_rules(monkeypatch):
    """hd64's 2 or 3 consumer warpgroups by how the tiles fill 132 SMs (docs section 47):
    batched causal takes 3 from 768 queries where the 192-row pairs make two rounds (one from
    4k); batched non-causal keeps 2 where its 128-row tiles fit one round. The 2-warpgroup
    non-causal config compiles, its loop on wgmma."""
    import dualattn.fast.sm90 as sm90
    monkeypatch.setattr(sm90, "_MODEL_SMS_ENV", "132")

    def tile_m(b, s, h, causal=True, mode="batched"):
        spec = AttentionSpec(mode, b, s, s, h, h, 64, 64, torch.bfloat16, "cuda", causal=causal)
        return FastSm90Forward.config(spec)[0]
    assert tile_m(8, 2048, 32) == 192 and tile_m(4, 2048, 16) == 192 and tile_m(12, 1536, 32) == 192
    assert tile_m(16, 1024, 32) == 192 and tile_m(2, 2048, 16) == 128 and tile_m(32, 767, 32) == 128
    assert tile_m(12, 1280, 32) == 192 and tile_m(2, 1280, 32) == 128  # 448 / 112 pairs
    assert tile_m(16, 768, 32) == 192 and tile_m(32, 640, 32) == 128
    assert tile_m(1, 4096, 16) == 192 and tile_m(1, 4096, 8) == 128  # 176 / 88 pairs
    assert tile_m(8, 2048, 32, mode="varlen") == 128 and tile_m(1, 16384, 1) == 192
    assert tile_m(2, 4095, 8) == 128  # 176 pairs < 2 x 132
    # non-causal: 128-row tiles that fit one round (1 x 1k x 16: 128) keep 2
    assert tile_m(1, 1024, 16, False) == 128 and tile_m(1, 1025, 16, False) == 192
    assert tile_m(1, 2048, 16, False) == 192 and tile_m(16, 1024, 32, False) == 192
    assert tile_m(1, 1024, 16, False, "varlen") == 192
    small = AttentionSpec("batched", 1, 1024, 1024, 16, 16, 64, 64, torch.bfloat16, "cuda", return_lse=True)
    assert not FastSm90Forward.key_split(small) and FastSm90Forward.q_regs(small)
    ptx = FastSm90Forward().compile_only(small, arch=90).__ptx__
    assert ".reqntid 384, 1, 1" in ptx and _loops_with(ptx, "wgmma.mma_async") >= 1


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_causal_chunks_of_small_grids_are_cut_into_pieces(monkeypatch):
    """Causal calls of at least 2k keys whose tiles fit half of 132 SMs and whose first tile sees
    half the keys run the persistent grid in the plain order (not pairs), with the stream-K merge
    compiled in, and each tile is cut into pieces along the key blocks it sees (P at most the
    first tile's blocks); so do chunks whose tiles fill more than half the SMs where the wave
    model finds pieces in rounds faster; more tiles, a first tile that sees under half the keys,
    a window or varlen keep the pairs / one CTA per tile. The plain-order causal config compiles for sm_90a
    with its merge's atomics."""
    import dualattn.fast.sm90 as sm90
    monkeypatch.setattr(sm90, "_MODEL_SMS_ENV", "132")
    monkeypatch.setattr(sm90, "_NUM_SMS_ENV", "132")  # (the launch's SM count: no GPU to ask)

    def spec(b, sq, sk, hq=32, hkv=8, d=128, **kw):
        return AttentionSpec("batched", b, sq, sk, hq, hkv, d, d, torch.bfloat16, "cuda", causal=True,
                             return_lse=True, **kw)
    F = FastSm90Forward()
    chunk = spec(1, 64, 32768)  # packed GQA: 2 query blocks x 8 KV heads
    assert sm90._causal_split_grid(chunk) and F.config(chunk)[5] and not F.paired(chunk)
    assert F.stream_k(chunk) and F.stream_k_plan(chunk, torch.device("cuda")) == (16, 256, 8, 128)
    decode = spec(4, 1, 8192, d=64)
    assert F.stream_k_plan(decode, torch.device("cuda")) == (32, 64, 4, 128)
    assert F.stream_k_plan(spec(1, 128, 32768), torch.device("cuda")) == (32, 256, 4, 128)
    # a 1k chunk of 4 heads against 8k keys: 32 tiles of 57-64 blocks, four pieces each
    assert F.stream_k_plan(spec(1, 1024, 8192, hq=4, hkv=4), torch.device("cuda")) == (32, 64, 4, 128)
    # pieces bounded by the first tile's blocks: 2k x 2 heads against 4k keys sees 17 of 32
    assert F.stream_k_plan(spec(1, 2048, 4096, hq=2, hkv=2, d=64), torch.device("cuda"))[2] == 4
    # tiles that fill more than half the SMs: the wave model's pieces, taken in rounds
    # (640 x 32k GQA: 160 tiles, 4 pieces each on 640 CTAs; tile_order.wave_pieces), not one CTA
    # a tile (32k keys: no persistent causal grid); off by its knob. A non-causal single round of
    # 96 tiles likewise (4 pieces, 384 CTAs)
    wave = spec(1, 640, 32768)
    assert sm90._causal_split_grid(wave) and not F.paired(wave) and F.config(wave)[5]
    assert F.stream_k_plan(wave, torch.device("cuda")) == (160, 256, 4, 640)
    monkeypatch.setattr(sm90, "_SPLIT_WAVES_ENV", "0")
    assert not sm90._causal_split_grid(wave) and not F.config(wave)[5]
    assert F.paired(spec(1, 640, 16384))  # (16k keys: the pairs' persistent grid)
    monkeypatch.setattr(sm90, "_SPLIT_WAVES_ENV", "")
    # hd256 past 2k keys runs one CTA a tile: 80 tiles of 640 x 32k GQA 16/4 on 132 SMs leave
    # 52 idle, which the model counts (sm90._causal_order_time): 3 pieces on 240 CTAs
    wide = spec(1, 640, 32768, hq=16, hkv=4, d=256)
    assert sm90._causal_split_grid(wide) and F.stream_k_plan(wide, torch.device("cuda")) == (80, 512, 3, 240)
    monkeypatch.setattr(sm90, "_SPLIT_WAVES_ENV", "0")
    assert not F.config(wide)[5]
    round96 = AttentionSpec("batched", 1, 256, 32768, 48, 48, 128, 128, torch.bfloat16, "cuda")
    assert F.stream_k_plan(round96, torch.device("cuda")) == (0, 0, 0, 96)
    monkeypatch.setattr(sm90, "_SPLIT_WAVES_ENV", "")
    assert F.stream_k_plan(round96, torch.device("cuda")) == (96, 256, 4, 384)
    for other in (spec(64, 1, 8192), spec(1, 1100, 32768), spec(1, 64, 32768, window=(1000, 0)),
                  spec(1, 64, 2047, hq=8, hkv=8), spec(1, 512, 8192),  # (the last: 128 tiles)
                  spec(1, 2048, 3000, hq=2, hkv=2)):  # the first tile sees under half the keys
        assert not sm90._causal_split_grid(other)
    assert F.paired(spec(1, 2048, 3000, hq=2, hkv=2))
    assert F.paired(spec(64, 1, 8192)) and not F.config(spec(1, 1100, 32768))[5]  # 280 tiles
    ptx = F.compile_only(chunk, arch=90).__ptx__
    assert any(".acq_rel." in ln and "atom." in ln for ln in ptx.splitlines())


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_hd64_without_masks_runs_three_consumer_warpgroups():
    """hd64 non-causal: tile_m 192 = 3 consumer warpgroups of 64 rows (512 threads, registers
    32 / 160 per producer / consumer thread, an epilogue per warp (warp syncs, no named
    barrier: FastSm90Forward.warp_store_o), the GEMM
    issue ordered in a ring of three named barriers); batched causal takes 3 from 768 queries
    where the 192-row pairs fill two rounds of the grid (one from 4k queries), else keeps 2."""
    spec = _spec(64, False)
    assert FastSm90Forward.config(spec)[0] == 192 and FastSm90Forward.config(spec)[3] is True
    assert FastSm90Forward.config(_spec(64, True, sq=700, sk=700))[0] == 128
    # plain causal hd64 runs the persistent grid; hd128 causal one CTA per tile past 4096 keys
    assert FastSm90Forward.config(_spec(64, True))[5] is True
    assert FastSm90Forward.config(_spec(128, True, sq=32768, sk=32768))[5] is False
    # causal from 4k queries: 3 warpgroups too; with 4 stages on the persistent grid (paired
    # order); varlen from 16k queries one CTA per tile and 3 stages
    mid_causal = _spec(64, True, sq=8192, sk=8192)
    assert FastSm90Forward.config(mid_causal)[:3] == (192, 128, 4) and FastSm90Forward.config(mid_causal)[5]
    assert FastSm90Forward.paired(mid_causal) and FastSm90Forward.q_stages(mid_causal) == 2
    kern = FORWARD.make_kernel(mid_causal)
    assert kern.num_mma_wg == 3 and kern.smem_bytes <= 227 * 1024
    assert FastSm90Forward.config(_spec(64, True, sq=767, sk=767))[0] == 128
    # from 16k queries: batched stays on the persistent grid (4 stages, the paired order),
    # varlen runs one CTA per tile with 3 stages
    long_causal = FastSm90Forward.config(_spec(64, True, sq=16384, sk=16384))
    assert long_causal[:3] == (192, 128, 4) and long_causal[3] is True and long_causal[5] is True
    assert FastSm90Forward.paired(_spec(64, True, sq=32768, sk=32768))
    varlen_long = AttentionSpec("varlen", 2, 16384, 16384, 8, 8, 64, 64, torch.bfloat16, "cuda", causal=True)
    assert FastSm90Forward.config(varlen_long)[:3] == (192, 128, 3) and FastSm90Forward.config(varlen_long)[5] is False
    assert FastSm90Forward.config(_spec(64, False, window=(64, -1)))[0] == 128
    ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
    assert ".reqntid 512, 1, 1" in ptx
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+32\b", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+160\b", ptx)
    assert FastSm90Forward.warp_store_o(spec)
    assert "bar.warp.sync" in ptx and not re.search(r"bar\.sync\s+%r\d+,\s*128;", ptx)
    assert not re.search(r"bar\.sync\s+1,", ptx)
    # the ring: each warpgroup waits on its own barrier (2, 3, 4) and arrives on the next one's
    assert re.search(r"bar\.sync\s+%r\d+,\s*256;", ptx) and re.search(r"bar\.arrive\s+%r\d+,\s*256;", ptx)
    assert _loops_with(ptx, "wgmma.mma_async") >= 1


@pytest.mark.compile_only
def test_pack_gqa_views_fold_the_group_into_rows():
    """With pack_gqa = g, row r of KV head h is query r // g of query head h * g + r % g, in Q, O
    and LSE alike (FlashFwdSm90.tensors_from_pointers): probed on CPU tensors like the test above."""
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    B, Sq, Sk, Hq, Hkv, D = 2, 5, 53, 8, 2, 64
    g = Hq // Hkv
    spec = AttentionSpec("batched", B, Sq, Sk, Hq, Hkv, D, D, torch.bfloat16, "cuda", return_lse=True)
    fwd = FastSm90Forward()
    assert fwd.pack_gqa(spec) == g and "_pack4" in fwd.compile_key(spec, 90)[0]
    kern = fwd.make_kernel(spec)
    sch = fwd.arg_schema(spec)
    probes = [(1, 17, 1, 9), (0, 0, 0, 0), (1, g * Sq - 1, Hkv - 1, D - 1), (0, 6, 1, 33)]  # (b, row, kv head, d)

    @cute.jit
    def probe(args, res_ptr):
        mQ, mK, mV, mO, mLSE = kern.tensors_from_pointers(*args.values[:19])
        r = cute.make_tensor(res_ptr, cute.make_layout(16))
        for i, (b, row, h, d) in enumerate(probes):
            r[i] = Float32(mQ[b, row, h, d])
            mO[b, row, h, d] = mO.element_type(10.0 + i)
            mLSE[b, h, row] = Float32(20.0 + i)
        r[8] = Float32(cute.size(mQ.shape[1]))
        r[9] = Float32(cute.size(mQ.shape[2]))

    fn = cute.compile(probe, sch.fake(), make_ptr(cutlass.Float32, 0, AddressSpace.gmem, 4))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, Sq, Hq, D, generator=gen).to(torch.bfloat16)
    k = torch.randn(B, Sk, Hkv, D, generator=gen).to(torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.zeros(B, Sq, Hq, D, dtype=torch.bfloat16)
    lse = torch.zeros(B, Hq, Sq)
    res = torch.zeros(16)
    fn(fwd.pack_args(sch.pack, fwd.scalar_fields(spec, 132), q, k, v, out, lse,
                     fwd.no_cut_fields(spec)),
       make_ptr(cutlass.Float32, res.data_ptr(), AddressSpace.gmem, 4))
    for i, (b, row, h, d) in enumerate(probes):
        s, hq = row // g, h * g + row % g
        assert res[i] == float(q[b, s, hq, d])
        assert out[b, s, hq, d] == 10.0 + i and lse[b, hq, s] == 20.0 + i
    assert out.count_nonzero() == len(probes) and lse.count_nonzero() == len(probes)
    assert res[8:10].tolist() == [g * Sq, Hkv]


def test_pack_gqa_choice():
    # packed: a power-of-two group, short queries, no per-head key ranges / CSR, not varlen
    assert FastSm90Forward.pack_gqa(_spec(128, sq=16)) == 4
    assert FastSm90Forward.pack_gqa(_spec(128, True, sq=1)) == 4
    assert FastSm90Forward.pack_gqa(_spec(128, True, sq=16)) == 4       # masks take row // g
    assert FastSm90Forward.pack_gqa(_spec(128, sq=16, window=(8, 8))) == 4
    assert FastSm90Forward.pack_gqa(_spec(128, sq=1000)) == 1           # long queries fill the tile
    assert FastSm90Forward.pack_gqa(AttentionSpec("batched", 1, 16, 99, 6, 2, 64, 64, torch.bfloat16,
                                                  "cuda")) == 1          # group of 3
    assert FastSm90Forward.pack_gqa(AttentionSpec("batched", 1, 16, 99, 4, 4, 64, 64, torch.bfloat16,
                                                  "cuda")) == 1          # MHA


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d,hq,hkv,causal,window", [(128, 32, 8, False, (-1, -1)), (128, 16, 4, True, (-1, -1)),
                                                     (64, 16, 2, False, (40, 0)), (256, 8, 1, True, (-1, -1))])
def test_pack_gqa_kernels_compile_with_a_5d_q_box(d, hq, hkv, causal, window):
    # the packed Q and O views add the group as a TMA dimension: Q loads (and the O store) are
    # 5-D boxes, K/V stay 4-D; the main loop is the dense one (wgmma in a loop)
    spec = AttentionSpec("batched", 2, 37, 300, hq, hkv, d, d, torch.bfloat16, "cuda", causal=causal,
                         window=window, return_lse=True)
    g = FastSm90Forward.pack_gqa(spec)
    assert g == hq // hkv
    ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
    assert re.search(r"cp\.async\.bulk\.tensor\.5d\.shared::cta\.global", ptx)   # Q
    assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::cta\.global", ptx)   # K, V
    assert re.search(r"cp\.async\.bulk\.tensor\.5d\.global\.shared::cta", ptx)   # O store
    assert _loops_with(ptx, "wgmma.mma_async") >= 1


@pytest.mark.compile_only
def test_short_masked_tiles_run_the_persistent_grid():
    """Causal / windowed calls at D <= 128 whose longest tile visits at most PERSISTENT_MAX_TILE_KEYS (4096) keys take the
    persistent grid (H100 A/B in FastSm90Forward's _short_masked_tiles), and so do plain causal
    calls at D = 128 up to 16k keys and at D = 256 up to 2k keys (PERSISTENT_MAX_CAUSAL_KEYS);
    longer causal ones, hd192, key ranges and CSRs with key ranges keep one CTA per tile."""
    from dualattn.fast.sm90 import PERSISTENT_MAX_CAUSAL_KEYS, PERSISTENT_MAX_TILE_KEYS
    from dualattn.sparse import BlockSparse

    def persistent(spec):
        return FastSm90Forward.config(spec)[5]
    assert persistent(_spec(96, True, sq=2048, sk=PERSISTENT_MAX_TILE_KEYS))
    assert not persistent(_spec(96, True, sq=2048, sk=PERSISTENT_MAX_TILE_KEYS + 1))
    for d, keys in PERSISTENT_MAX_CAUSAL_KEYS.items():
        assert persistent(_spec(d, True, sq=2048, sk=keys)) and FastSm90Forward.paired(_spec(d, True, sq=2048, sk=keys))
        assert not persistent(_spec(d, True, sq=2048, sk=keys + 1))
    assert persistent(_spec(96, True, sq=512, sk=512))
    assert not persistent(_spec(192, True, sq=512, sk=512))
    # a window bounded on both sides: its span, not Sk, bounds a tile's keys
    assert persistent(_spec(128, True, sq=16384, sk=16384, window=(1024, 0)))
    assert not persistent(_spec(128, True, sq=16384, sk=16384, window=(4096, 0)))
    assert not persistent(_spec(256, True, sq=512, sk=512, window=(64, 0)))  # hd256: plain causal only
    assert not persistent(_spec(128, False, sq=16384, sk=16384, window=(-1, 0)))  # right bound alone
    assert persistent(_spec(128, False, sq=16384, sk=16384, window=(1000, 1000)))
    bs = BlockSparse.from_key_ranges(None, 1000, 1000, 128, 128, causal=True)
    # a CSR without key ranges at D <= 128 is persistent (fast/sm90._persistent_csr); with key
    # ranges, or at hd256, one CTA per tile
    assert persistent(_spec(128, True, block_size=(bs.block_m, bs.block_n)))
    assert not persistent(_spec(128, True, block_size=(bs.block_m, bs.block_n), num_key_ranges=1))
    assert not persistent(_spec(256, True, block_size=(bs.block_m, bs.block_n)))


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_persistent_configs_double_buffer_q_where_shared_memory_allows():
    """A persistent CTA with its own O buffer keeps two Q buffers (the next tile's Q and first K/V
    load while this tile runs): two Q stages in the compile key and the kernel, and the
    shared-memory budget (checked at trace time) still met at hd128 (224 KB + barriers)."""
    hd128 = _spec(128, False, sq=8192, sk=8192)
    assert FastSm90Forward.config(hd128)[5] and FastSm90Forward.q_stages(hd128) == 2
    assert FORWARD.compile_key(hd128, 90)[-16] == 2
    assert FastSm90Forward.q_stages(_spec(128, True, sq=32768, sk=32768)) == 1  # one CTA per tile
    assert FastSm90Forward.q_stages(_spec(256, False, sq=8192, sk=8192)) == 1  # O aliases Q
    kern = FORWARD.make_kernel(hd128)
    assert kern.q_stages == 2 and kern.smem_bytes <= 227 * 1024
    ptx = FastSm90Forward().compile_only(hd128, arch=90).__ptx__
    smem = [int(x) for x in re.findall(r"\.shared \.align \d+ \.b8 \w+\[(\d+)\]", ptx)]
    assert not smem or max(smem) <= 227 * 1024


@pytest.mark.compile_only
def test_o_rescale_placement_rule():
    """O's rescale: before the P V (beside the next Q K^T) for D = Dv = 128 on the persistent
    grid; a threshold (no rescale while the max moves by <= 2^8) from Dv 192; after the P V wait
    elsewhere (FastSm90Forward.rescale_before_pv / rescale_threshold, measured on the H100)."""
    before, thr = FastSm90Forward.rescale_before_pv, FastSm90Forward.rescale_threshold
    assert before(_spec(128, False, sq=8192, sk=8192)) and thr(_spec(128, False, sq=8192, sk=8192)) == 0.0
    assert before(_spec(128, True, sq=2048, sk=2048))                 # short causal: persistent
    assert before(_spec(128, True, sq=16384, sk=16384))               # causal to 16k: persistent
    assert not before(_spec(128, True, sq=32768, sk=32768))           # one CTA per tile
    assert not before(_spec(64, False, sq=8192, sk=8192)) and not before(_spec(192, False, sq=8192, sk=8192, dv=128))
    assert not before(_spec(256, False, sq=8192, sk=8192)) and thr(_spec(256, False, sq=8192, sk=8192)) == 8.0
    kern = FORWARD.make_kernel(_spec(128, False, sq=8192, sk=8192))
    assert kern.rescale_before_pv and kern.rescale_threshold == 0.0
    assert FORWARD.compile_key(_spec(128, False, sq=8192, sk=8192), 90)[-12] is True


@pytest.mark.compile_only
def test_hd256_key_tile_rule():
    """hd256 takes 64-wide key tiles except causal calls from 8k queries (80), measured on the
    H100 (fast/sm90._narrow_hd256_tile); a CSR keeps its own rule; the kernel still fits."""
    from dualattn.sparse import BlockSparse
    tile_n = lambda spec: FastSm90Forward.config(spec)[1]  # noqa: E731
    assert tile_n(_spec(256, False, sq=16384, sk=16384)) == 64
    assert tile_n(_spec(256, True, sq=4096, sk=4096)) == 64
    assert tile_n(_spec(256, True, sq=8192, sk=8192)) == 80
    assert tile_n(_spec(256, False, sq=8192, sk=8192, window=(-1, 0))) == 80  # right bound: causal-like
    assert tile_n(_spec(192, False, sq=8192, sk=8192)) == 112
    bs = BlockSparse.from_key_ranges(None, 1024, 1024, 128, 128, causal=True)
    assert tile_n(_spec(256, True, sq=1024, sk=1024, block_size=(bs.block_m, bs.block_n))) == 64
    kern = FORWARD.make_kernel(_spec(256, False, sq=8192, sk=8192))
    assert kern.tile_n == 64 and kern.smem_bytes <= 227 * 1024


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d, causal, window, sq_range, hq, hkv", [
    (128, True, (-1, -1), (65, 3000), 4, 4),      # 128-row tiles
    (64, True, (-1, -1), (4096, 9000), 16, 16),   # 3 warpgroups: 192-row tiles (enough pairs)
    (256, True, (-1, -1), (65, 2048), 4, 4),      # 64-key tiles
    (128, True, (-1, -1), (1, 64), 32, 8),        # packed GQA rows (g = 4)
    (128, False, (-1, 77), (65, 3000), 4, 2),     # a right window bound alone
])
def test_paired_key_blocks_transcribes_the_kernels_bounds(d, causal, window, sq_range, hq, hkv):
    """The launch gives every pair of a stream-K call the length of the longest
    (paired_key_blocks, a host transcription): were a tile longer in the kernel, its last key
    blocks (the diagonal) would be dropped. The kernel's own key_block_bounds, compiled for the
    host and run there, must give the same count for every query block, over random shapes."""
    import random
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    def spec_of(sq, sk):
        return AttentionSpec("batched", 1, sq, sk, hq, hkv, d, d, torch.bfloat16, "cuda", causal=causal,
                             window=window, return_lse=True)
    base = spec_of(sq_range[0], sq_range[1])
    assert FastSm90Forward.paired(base) and base.window[0] < 0  # (a call stream-K may cut)
    probes = {}  # the kernel with and without end_aligned (hd256's O slot, and so it, comes with the grid)

    def probe_of(spec):
        ea = FastSm90Forward.end_aligned(spec)
        if ea not in probes:
            kern = FastSm90Forward().make_kernel(spec)

            @cute.jit
            def probe(out_ptr: cute.Pointer, rows: Int32, seqlen_k: Int32, win_left: Int32, win_right: Int32,
                      num_m: Int32):
                out = cute.make_tensor(out_ptr, cute.make_layout((num_m, 2), stride=(2, 1)))
                # the rows the tiles cover (end_aligned: the shift more), from a Q-shaped view
                tiled_rows = kern.q_rows(cute.make_tensor(out_ptr, cute.make_layout((rows, 1))))
                for m in cutlass.range(num_m, unroll=1):
                    lo, hi = kern.key_block_bounds(m, tiled_rows, seqlen_k, win_left, win_right)
                    out[m, 0] = lo
                    out[m, 1] = hi

            probes[ea] = cute.compile(probe, make_ptr(cutlass.Int32, 0, AddressSpace.gmem, 4), 0, 0, 0, 0, 0)
        return probes[ea]

    rng = random.Random(5)
    for _ in range(40):
        sq = rng.randint(*sq_range)
        # offsets next to a key-block edge catch an off-by-one in the bound
        sk = rng.choice([sq, rng.randint(sq, 3 * sq + 200), rng.randint(max(sq // 2, 1), sq),
                         sq + rng.choice([1, 2, 63, 64, 65, 127, 129])])
        spec = spec_of(sq, sk)
        assert FastSm90Forward.config(spec)[:2] == FastSm90Forward.config(base)[:2]
        assert FastSm90Forward.pack_gqa(spec) == FastSm90Forward.pack_gqa(base)
        g = FastSm90Forward.pack_gqa(spec)
        tile_m = FastSm90Forward.config(spec)[0]
        num_m = -(-(g * sq) // tile_m)
        out = torch.full((num_m, 2), -7, dtype=torch.int32)
        _, wl, wr, _, _ = FastSm90Forward.runtime_scalars(spec)
        probe_of(spec)(make_ptr(cutlass.Int32, out.data_ptr(), AddressSpace.gmem, 4), g * sq, sk, wl, wr, num_m)
        key_blocks = FastSm90Forward.paired_key_blocks(spec)
        got = [max(int(hi) - int(lo), 0) for lo, hi in out.tolist()]
        assert got == [key_blocks(m) for m in range(num_m)], (sq, sk)


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d, sq, window, hq, hkv", [
    (256, 2048, (-1, -1), 4, 4),   # 64-key tiles: the first warpgroup never sees the last block
    (256, 8192, (-1, -1), 4, 4),   # 80-key tiles
    (192, 1000, (-1, -1), 4, 4),   # 112-key tiles
    (256, 1000, (-1, 37), 4, 4),   # a right window bound alone
    (256, 48, (-1, -1), 32, 8),    # packed GQA rows, where the pack applies at hd256
    (64, 4224, (-1, -1), 16, 16),  # ping-pong, 3 warpgroups: 192-row tiles on 128-key tiles
    (128, 1000, (-1, -1), 4, 4),   # ping-pong, 128 x 128 tiles (blocks hidden at offsets only)
    (128, 48, (-1, -1), 32, 8),    # ping-pong, packed GQA rows
])
def test_wg_key_block_end_hides_only_blocks_no_row_of_the_warpgroup_sees(d, sq, window, hq, hkv):
    """wg_key_block_end (the kernel's own code, compiled for the host): the key blocks at or past
    it hold no key that any of the warpgroup's 64 rows sees, and the block before it holds one
    (the bound is exact), over random shapes and offsets; every such block is one the tile
    visits masked (so passing it leaves the tile's masked/unmasked split intact)."""
    import random
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace
    from test_sm90_visit_plan import dense_visits

    causal = window == (-1, -1)
    base = AttentionSpec("batched", 1, sq, sq, hq, hkv, d, d, torch.bfloat16, "cuda", causal=causal,
                         window=window, return_lse=True)
    kern = FastSm90Forward().make_kernel(base)
    g, bm, bn = kern.pack_gqa, kern.tile_m, kern.tile_n
    wgs = bm // 64

    @cute.jit
    def probe(out_ptr: cute.Pointer, rows: Int32, seqlen_k: Int32, win_right: Int32, num_m: Int32):
        out = cute.make_tensor(out_ptr, cute.make_layout((num_m, wgs), stride=(wgs, 1)))
        for m in cutlass.range(num_m, unroll=1):
            for w in cutlass.range_constexpr(wgs):
                out[m, w] = kern.wg_key_block_end(m, w, rows, seqlen_k, win_right)

    fn = cute.compile(probe, make_ptr(cutlass.Int32, 0, AddressSpace.gmem, 4), 0, 0, 0, 0)
    rng = random.Random(7)
    seen_hidden = 0
    for _ in range(60):
        sq_ = rng.randint(1, sq)
        sk = rng.choice([sq_, rng.randint(1, 3 * sq_ + 200), sq_ + rng.choice([1, 63, 64, 65, 79, 81, 113]),
                         sq_ + rng.randint(0, 2 * bn)])
        spec = replace(base, seqlen_q=sq_, seqlen_k=sk)
        assert FastSm90Forward.pack_gqa(spec) == g
        _, wl, wr, _, _ = FastSm90Forward.runtime_scalars(spec)
        num_m = -(-(g * sq_) // bm)
        out = torch.full((num_m, wgs), -7, dtype=torch.int32)
        fn(make_ptr(cutlass.Int32, out.data_ptr(), AddressSpace.gmem, 4), g * sq_, sk, wr, num_m)
        offs = sk - sq_
        for m in range(num_m):
            # the tile's visits (the transcription knows no packed rows: their tile bound here)
            visits = dict(dense_visits(m, bm, bn, sq_, sk, causal, -1, window[1])) if g == 1 else None
            last_q = min((m * bm + bm - 1) // g, sq_ - 1)
            n_block_max = min(-(-sk // bn), -(-max(last_q + 1 + offs + wr, 0) // bn))
            if visits is not None:
                assert n_block_max == (max(visits) + 1 if visits else n_block_max)
            for w in range(wgs):
                end = int(out[m, w])
                qs = {(m * bm + 64 * w + r) // g for r in range(64) if m * bm + 64 * w + r < g * sq_}
                hi = {i: min(i + offs + wr, sk - 1) for i in qs}   # last key row i sees
                seen = {j // bn for i in qs for j in range(max(hi[i] + 1, 0))}
                assert all(n < end for n in seen), (sq_, sk, m, w, end, seen)
                if m * bm + 64 * w + 63 < g * sq_ and max(hi.values()) >= 0 and end - 1 < n_block_max:
                    assert end - 1 in seen, (sq_, sk, m, w, end)   # exact where row 63 is stored
                for n in range(end, n_block_max):
                    assert visits is None or visits[n], (sq_, sk, m, w, n)   # a masked visit
                    seen_hidden += 1
    assert seen_hidden > (20 if g == 1 else 0)


def _warpgroup_block_probe(kern, test: str, bound: str, nb: int):
    """The kernel's per-warpgroup block test ``test`` (first_block_is_narrow /
    last_block_is_narrow) compiled for the host: (rows, seqlen_k, the window bound named
    ``bound``, query blocks) -> its answer for every (query block, warpgroup, key block < nb)."""
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace
    from dualattn.fast.sm90.flash_fwd import _Ctx

    wgs = kern.tile_m // 64
    method = getattr(kern, test)

    @cute.jit
    def probe(out_ptr: cute.Pointer, rows: Int32, seqlen_k: Int32, win: Int32, num_m: Int32):
        out = cute.make_tensor(out_ptr, cute.make_layout((num_m, wgs, nb), stride=(wgs * nb, nb, 1)))
        for m in cutlass.range(num_m, unroll=1):
            for w in cutlass.range_constexpr(wgs):
                ctx = _Ctx(m_block=m, wg=w, seqlen_q=rows, seqlen_k=seqlen_k, **{bound: win})
                for n in cutlass.range(nb, unroll=1):
                    out[m, w, n] = Int32(method(ctx, n))

    fn = cute.compile(probe, make_ptr(cutlass.Int32, 0, AddressSpace.gmem, 4), 0, 0, 0, 0)

    def run(rows, seqlen_k, win, num_m):
        out = torch.full((num_m, wgs, nb), -7, dtype=torch.int32)
        fn(make_ptr(cutlass.Int32, out.data_ptr(), AddressSpace.gmem, 4), rows, seqlen_k, win, num_m)
        assert int(out.min()) >= 0
        return out
    return run


def test_narrow_last_visit_order_is_the_consumers_and_a_permutation():
    """block_info.masked_last_visit (the TMA warp's order in narrow_last configs) visits every
    key block of the tile once, and in the consumers' order: the first block, the unmasked
    ones, then every masked one after the first (right-masked, then left-masked), so one
    loop runs all the masked steps (FlashFwdSm90.blocks_after_first_narrow_last)."""
    from dualattn.fast.common.block_info import masked_last_groups, masked_last_visit

    def select(c, a, b):
        return a if c else b

    for n in range(0, 12):
        for n_masked in range(0, n + 1):
            for n_left in range(0, n - n_masked + 1):
                order = [masked_last_visit(i, n, n_masked, n_left, max, select) for i in range(n)]
                assert sorted(order) == list(range(n)), (n, n_masked, n_left, order)
                if n == 0:
                    continue
                u0, unmasked, right, l0 = masked_last_groups(n, n_masked, n_left, max)
                consumer = ([0] + [u0 + i for i in range(unmasked)]
                            + [1 + i if i < right else l0 + i - right for i in range(right + max(n - l0, 0))])
                assert order == consumer, (n, n_masked, n_left)
                masked = [v < n_masked or v >= n - n_left for v in order]
                # after the first: the unmasked visits, then only masked ones
                tail = masked[1:]
                assert tail == sorted(tail), (n, n_masked, n_left, masked)


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d,sq,window,hq,hkv", [
    (128, 1000, (300, 0), 4, 4),    # ping-pong 128 x 128 tiles, causal window
    (64, 5000, (1024, 0), 4, 4),    # 3 warpgroups, 192 x 128 tiles
    (96, 1000, (77, 200), 4, 4),    # a two-sided window
    (128, 48, (100, 0), 32, 8),     # packed GQA rows
])
def test_narrow_last_block_holds_no_key_of_the_warpgroup_in_its_lower_half(d, sq, window, hq, hkv):
    """last_block_is_narrow (the kernel's own code, compiled for the host): where it says a
    warpgroup may compute only the upper half of key block n, none of the warpgroup's rows sees
    a key in the lower half, and where it says no, one does (so the test is exact, not only
    safe), over random shapes and left bounds and every key block."""
    import random

    base = AttentionSpec("batched", 1, sq, sq, hq, hkv, d, d, torch.bfloat16, "cuda",
                         causal=window[1] == 0, window=(window[0], -1 if window[1] == 0 else window[1]),
                         return_lse=True)
    assert FastSm90Forward.narrow_last(base)
    kern = FastSm90Forward().make_kernel(base)
    assert kern.narrow_last
    g, bm, bn = kern.pack_gqa, kern.tile_m, kern.tile_n
    wgs = bm // 64
    nb = -(-3 * sq // bn) + 8
    probe = _warpgroup_block_probe(kern, "last_block_is_narrow", "win_left", nb)
    rng = random.Random(5)
    narrow_seen = 0
    for trial in range(40):
        sq_ = sq if trial == 0 else rng.randint(1, sq)
        sk = sq_ if trial == 0 else rng.choice([sq_, rng.randint(1, 3 * sq_ + 200),
                                                sq_ + rng.choice([1, 31, 64, 65, 113])])
        wl = window[0] if trial == 0 else rng.randint(0, 2 * bn + 50)
        num_m = -(-(g * sq_) // bm)
        out = probe(g * sq_, sk, wl, num_m)
        offs = sk - sq_
        for m in range(num_m):
            for w in range(wgs):
                qs = {(m * bm + 64 * w + r) // g for r in range(64) if m * bm + 64 * w + r < g * sq_}
                first_seen = min((max(i + offs - wl, 0) for i in qs), default=1 << 30)
                for n in range(nb):
                    if out[m, w, n]:
                        assert first_seen >= n * bn + bn // 2, (sq_, sk, wl, m, w, n, first_seen)
                        narrow_seen += 1
                    elif qs:  # exact: the first row's first key is the warpgroup's first
                        assert first_seen < n * bn + bn // 2, (sq_, sk, wl, m, w, n, first_seen)
    assert narrow_seen > 10


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d,sq,window,hq,hkv", [
    (128, 1000, (-1, -1), 4, 4),   # ping-pong, 128 x 128 tiles: the diagonal's first warpgroup
    (64, 5000, (-1, -1), 16, 16),  # 3 warpgroups, 192 x 128 tiles (enough pairs)
    (256, 1000, (-1, -1), 4, 4),   # 128 x 64 tiles
    (192, 1000, (-1, 77), 4, 4),   # 112-key tiles, a right window bound
    (128, 48, (-1, -1), 32, 8),    # packed GQA rows
])
def test_narrow_first_block_holds_no_key_of_the_warpgroup_in_its_upper_half(d, sq, window, hq, hkv,
                                                                          monkeypatch):
    """first_block_is_narrow (the kernel's own code, compiled for the host): where it says a
    warpgroup may compute only the lower half of key block n, none of the warpgroup's 64 rows sees
    a key in the upper half, over random shapes, offsets and every block a tile visits. And it is
    not vacuous: it holds for the first warpgroup's diagonal block of causal tiles. (On by default
    at D <= 128; D > 128 runs with DUALATTN_SM90_NARROW_FIRST=1.)"""
    import random
    import dualattn.fast.sm90 as sm90

    causal = window == (-1, -1)
    base = AttentionSpec("batched", 1, sq, sq, hq, hkv, d, d, torch.bfloat16, "cuda", causal=causal,
                         window=window, return_lse=True)
    assert FastSm90Forward.narrow_first(base) == (d <= 128)
    monkeypatch.setattr(sm90, "_NARROW_FIRST_ENV", "1")
    assert FastSm90Forward.narrow_first(base)
    kern = FastSm90Forward().make_kernel(base)
    g, bm, bn = kern.pack_gqa, kern.tile_m, kern.tile_n
    wgs = bm // 64
    nb = -(-3 * sq // bn) + 8  # enough key blocks for any drawn seqlen_k
    probe = _warpgroup_block_probe(kern, "first_block_is_narrow", "win_right", nb)
    rng = random.Random(11)
    narrow_seen = 0
    for trial in range(40):
        sq_ = sq if trial == 0 else rng.randint(1, sq)
        sk = sq_ if trial == 0 else rng.choice(
            [sq_, rng.randint(1, 3 * sq_ + 200), sq_ + rng.choice([1, 31, 32, 33, 63, 64, 65, 113]),
             sq_ + rng.randint(0, 2 * bn)])
        spec = replace(base, seqlen_q=sq_, seqlen_k=sk)
        _, wl, wr, _, _ = FastSm90Forward.runtime_scalars(spec)
        num_m = -(-(g * sq_) // bm)
        out = probe(g * sq_, sk, wr, num_m)
        offs = sk - sq_
        for m in range(num_m):
            last_q = min((m * bm + bm - 1) // g, sq_ - 1)
            n_block_max = min(-(-sk // bn), -(-max(last_q + 1 + offs + wr, 0) // bn))
            for w in range(wgs):
                qs = {(m * bm + 64 * w + r) // g for r in range(64) if m * bm + 64 * w + r < g * sq_}
                last_seen = max((min(i + offs + wr, sk - 1) for i in qs), default=-1)
                for n in range(n_block_max):
                    if out[m, w, n]:
                        assert last_seen < n * bn + bn // 2, (sq_, sk, m, w, n, last_seen)
                        narrow_seen += n == n_block_max - 1
                if trial == 0 and causal and g == 1 and w == 0 and (m * bm) % bn == 0 \
                        and m * bm + 63 < sq_:
                    # the aligned diagonal: warpgroup 0's rows see the block's first 64 keys
                    assert out[m, 0, n_block_max - 1], (m, n_block_max)
    assert narrow_seen > 10


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_wg_key_bound_is_on_where_measured_to_gain(monkeypatch):
    """Each warpgroup's own key bound is on by default for right-bounded configs without
    ping-pong (D > 128) except hd256's 80-wide key tiles (causal from 8k queries, where it
    measured slower), and for hd64's 192-row ping-pong tiles on 128-key blocks without a left
    window bound, stream-K's cut pairs included (they hide three warpgroup blocks in every two
    causal tiles); never for key ranges / CSR / non-right-bounded ones. 128-row ping-pong configs
    have it only with DUALATTN_SM90_WG_KEY_BOUND=1 (nothing hides when Sq = Sk); =0 turns it
    off everywhere. It is its own compile key; on, the kernel assembles for sm_90a with one more
    key-block loop: the hidden blocks' pass (mbarrier waits, no wgmma; the same loop as
    pass_empty_wg's, which is off here)."""
    import dualattn.fast.sm90 as sm90
    monkeypatch.setattr(sm90, "_PASS_EMPTY_WG_ENV", "0")
    on_specs = [_spec(256, True, sq=2048, sk=2048), _spec(192, True, sq=1000, sk=1300),
                _spec(192, True, sq=8192, sk=8192),
                _spec(256, False, sq=1000, sk=1000, window=(-1, 37)),
                _spec(64, True, sq=16384, sk=16384), _spec(64, True, sq=8192, sk=8192)]
    assert all(FastSm90Forward.config(s)[:4] == (192, 128, 4, True) for s in on_specs[-2:])
    assert FastSm90Forward.stream_k(on_specs[-1])  # (the cut pairs run it too)
    wide = _spec(256, True, sq=8192, sk=8192)
    pingpong = [_spec(128, True, sq=2048, sk=2048), _spec(64, True, sq=700, sk=700)]
    assert all(FastSm90Forward.config(s)[:2] == (128, 128) for s in pingpong)
    off_specs = [_spec(256, False, sq=2048, sk=2048),
                 _spec(256, True, sq=2048, sk=2048, num_key_ranges=1)]
    assert FastSm90Forward.config(wide)[1] == 80
    assert all(FastSm90Forward.wg_key_bound(s) for s in on_specs)
    assert not any(FastSm90Forward.wg_key_bound(s) for s in off_specs + pingpong + [wide])
    key_on = FORWARD.compile_key(on_specs[0], 90)
    ptx_on = FORWARD.compile_only(on_specs[0], arch=90).__ptx__
    monkeypatch.setattr(sm90, "_WG_KEY_BOUND_ENV", "1")
    assert all(FastSm90Forward.wg_key_bound(s) for s in on_specs + pingpong + [wide])
    assert not any(FastSm90Forward.wg_key_bound(s) for s in off_specs)
    monkeypatch.setattr(sm90, "_WG_KEY_BOUND_ENV", "0")
    assert not any(FastSm90Forward.wg_key_bound(s) for s in on_specs + off_specs + pingpong + [wide])
    assert FORWARD.compile_key(on_specs[0], 90) != key_on
    ptx_off = FORWARD.compile_only(on_specs[0], arch=90).__ptx__
    assert _loops_with(ptx_on, "mbarrier.try_wait") > _loops_with(ptx_off, "mbarrier.try_wait")
    assert _loops_with(ptx_on, "wgmma.mma_async") == _loops_with(ptx_off, "wgmma.mma_async")
    # configs without the intra-warpgroup overlap (the tile override's sixth field) never take it
    monkeypatch.setattr(sm90, "_WG_KEY_BOUND_ENV", "")
    monkeypatch.setenv("DUALATTN_SM90_TILES", "64:128,4,1,1,3,0")
    assert FastSm90Forward.config(on_specs[-1])[:5] == (192, 128, 4, True, False)
    assert not FastSm90Forward.wg_key_bound(on_specs[-1])


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_tile_decoder_takes_the_coordinates_off_the_tma_warp(monkeypatch):
    """FastSm90Forward.tile_decoder: on by default for persistent grids with tile_info, off
    where a CTA runs one tile or with DUALATTN_SM90_TILE_DECODER=0 / tile_info off; its own
    compile-key field (index 26). On, no loop that issues TMA loads divides (item_coords runs in
    the decoder warp alone), where off the TMA warp's tile loop does; and the tile-info ring has
    TILE_INFO_STAGES_DECODER stages (two more mbarriers per added stage)."""
    import dualattn.fast.sm90 as sm90
    from dualattn.fast.sm90.flash_fwd import TILE_INFO_STAGES, TILE_INFO_STAGES_DECODER
    spec = _spec(128, True, sq=2048, sk=2048)
    one_cta_per_tile = _spec(192, True, torch.float16)
    assert FastSm90Forward.config(spec)[5] and not FastSm90Forward.config(one_cta_per_tile)[5]
    assert FastSm90Forward.tile_decoder(spec) and not FastSm90Forward.tile_decoder(one_cta_per_tile)
    key_on = FORWARD.compile_key(spec, 90)
    ptx_on = FORWARD.compile_only(spec, arch=90).__ptx__
    monkeypatch.setattr(sm90, "_TILE_INFO_ENV", "0")
    assert not FastSm90Forward.tile_decoder(spec)
    monkeypatch.setattr(sm90, "_TILE_INFO_ENV", "")
    monkeypatch.setattr(sm90, "_TILE_DECODER_ENV", "0")
    assert not FastSm90Forward.tile_decoder(spec)
    key_off = FORWARD.compile_key(spec, 90)
    assert [i for i, (a, b) in enumerate(zip(key_on, key_off)) if a != b] == [26]
    ptx_off = FORWARD.compile_only(spec, arch=90).__ptx__
    tma_loops = _loops_with(ptx_on, "cp.async.bulk.tensor")
    assert tma_loops == _loops_with(ptx_off, "cp.async.bulk.tensor") >= 2
    assert _loops_with(ptx_on, "cp.async.bulk.tensor", "div.") == tma_loops
    assert _loops_with(ptx_off, "cp.async.bulk.tensor", "div.") == tma_loops - 1
    added = 2 * (TILE_INFO_STAGES_DECODER - TILE_INFO_STAGES)
    assert ptx_on.count("mbarrier.init") == ptx_off.count("mbarrier.init") + added


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_empty_warpgroups_pass_their_blocks_where_the_loop_is_plain(monkeypatch):
    """FastSm90Forward.pass_empty_wg: on for every config with the plain key-block loops (not key
    ranges or CSRs, which have their own); its own compile-key field (index 21, with the turned
    order of rotate_m_blocks); on, the hd64
    192-row kernel has one more key-block loop that waits on barriers and issues no wgmma (the
    pass)."""
    import dualattn.fast.sm90 as sm90
    hd64 = _spec(64, sq=1024, sk=1024)
    assert FastSm90Forward.config(hd64)[0] == 192
    varlen = AttentionSpec("varlen", 3, 1000, 1000, 8, 2, 128, 128, torch.bfloat16, "cuda", causal=True)
    on = [hd64, _spec(128, True), _spec(256), varlen]
    assert all(FastSm90Forward.pass_empty_wg(s) for s in on)
    assert not FastSm90Forward.pass_empty_wg(_spec(128, num_key_ranges=1))
    key_on = FORWARD.compile_key(hd64, 90)
    assert key_on[21] == 2  # passes, and the turned order
    monkeypatch.setattr(sm90, "_PASS_EMPTY_WG_ENV", "pass")
    assert FORWARD.compile_key(hd64, 90)[21] == 1 and not FORWARD.make_kernel(hd64).rotate_m_blocks
    ptx_on = FORWARD.compile_only(hd64, arch=90).__ptx__
    monkeypatch.setattr(sm90, "_PASS_EMPTY_WG_ENV", "0")
    assert not any(FastSm90Forward.pass_empty_wg(s) for s in on)
    assert FORWARD.compile_key(hd64, 90) != key_on
    ptx_off = FORWARD.compile_only(hd64, arch=90).__ptx__
    passes_on = _loops_with(ptx_on, "mbarrier.try_wait", without="wgmma.mma_async")
    assert passes_on > _loops_with(ptx_off, "mbarrier.try_wait", without="wgmma.mma_async")
    assert _loops_with(ptx_on, "wgmma.mma_async") >= 1


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d, causal, window, hq, hkv, nkr", [
    (128, True, (-1, -1), 4, 4, 0),      # 128 x 128 tiles: a 32-element row fragment
    (64, True, (-1, -1), 4, 4, 0),       # hd64 causal (3 warpgroups from 4k queries: 192 rows)
    (256, True, (-1, -1), 4, 4, 0),      # 64-key tiles: 16 elements
    (256, True, (-1, -1), 2, 2, 0),      # (2 heads: 9000 queries) 80-key tiles: 20 elements
    (192, True, (-1, -1), 4, 4, 0),      # 112-key tiles: 28 elements
    (128, False, (300, 17), 4, 4, 0),    # both window bounds
    (128, False, (-1, -1), 4, 4, 0),     # the key tail alone
    (128, True, (-1, -1), 32, 8, 0),       # packed GQA rows (g = 4)
    (128, False, (-1, -1), 4, 4, 2),       # two key ranges per query
    (64, True, (-1, -1), 4, 4, 1),         # a key range and the causal bound
])
@pytest.mark.parametrize("bit_mask", [True, False])
def test_element_mask_matches_brute_force_on_every_thread(d, causal, window, hq, hkv, nkr, bit_mask):
    """The kernel's element mask (FlashFwdSm90.mask_predicate: a bit set per row, or a compare
    per element), compiled for the host and run for every consumer thread's accumulator
    fragment of a tile (the same wgmma partition as the kernel): exactly the scores of keys a
    row does not see are -inf, over random shapes, query and key blocks (both sides of the
    diagonal, past the key tail) and window bounds. This also pins the fragment's column pattern
    (pairs of columns, one pair in every 8) that the bit sets assume. With key ranges the
    rows' intervals come from the kernel's own load_key_ranges."""
    import random
    import types
    from cutlass import Float32
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace
    from dualattn.fast.common.mask import load_key_ranges
    from dualattn.fast.sm90 import flash_fwd as ff

    # hd64 causal takes 192-row tiles from 4k queries, causal hd256 80-key tiles from 8k
    sq_max = 9000 if d == 64 or hq == 2 else 3000
    base = AttentionSpec("batched", 1, sq_max, sq_max, hq, hkv, d, d, torch.bfloat16, "cuda",
                         causal=causal, window=window, return_lse=True, num_key_ranges=nkr)
    kern = FastSm90Forward().make_kernel(base)
    kern.bit_mask = bit_mask
    g, bm, bn = kern.pack_gqa, kern.tile_m, kern.tile_n
    if hq == 2:
        assert bn == 80   # the case exists for this tile

    @cute.jit
    def probe(out_ptr: cute.Pointer, kr_ptr: cute.Pointer, m_block: Int32, n_block: Int32,
              rows: Int32, seqlen_k: Int32, win_left: Int32, win_right: Int32):
        out = cute.make_tensor(out_ptr, cute.make_layout((bm, bn), stride=(bn, 1)))
        mKR = cute.make_tensor(kr_ptr, cute.make_layout(max(2 * nkr, 1) * sq_max))
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            kern.dtype, kern.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, atom_layout_mnk=(bm // 64, 1, 1), tiler_mn=(64, bn))
        for tidx in cutlass.range(bm // 64 * 128, unroll=1):
            thr = tiled_mma.get_slice(tidx)
            tScS = thr.partition_C(cute.make_identity_tensor((bm, bn)))
            tScS_mn = cute.make_tensor(tScS.iterator, ff._acc_mn_layout(tScS.layout))
            acc = cute.make_rmem_tensor(thr.partition_shape_C((bm, bn)), Float32)
            acc.fill(1.0)
            acc_mn = cute.make_tensor(acc.iterator, ff._acc_mn_layout(acc.layout))
            ctx = ff._Ctx(tScS_mn=tScS_mn, m_block=m_block, seqlen_q=rows, seqlen_k=seqlen_k,
                          win_left=win_left, win_right=win_right, kr=None)
            if cutlass.const_expr(nkr > 0):
                ctx.kr = load_key_ranges(mKR, 0, 0, tScS_mn, m_block * bm, rows, nkr)[0]
            kern.mask_predicate(ctx, acc_mn, n_block * bn)
            for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    out[tScS_mn[r, c][0], tScS_mn[r, c][1]] = acc_mn[r, c]

    ptr = lambda t=None, ty=cutlass.Float32: make_ptr(ty, 0 if t is None else t.data_ptr(), AddressSpace.gmem, 4)
    # the wgmma atom exists only for sm_90a (the probe itself is host code)
    fn = cute.compile(probe, ptr(), ptr(ty=cutlass.Int32), 0, 0, 0, 0, 0, 0, options="--gpu-arch sm_90a")
    rng = random.Random(11)
    for _ in range(12):
        sq = rng.randint(1, sq_max)
        sk = rng.choice([sq, rng.randint(1, 3 * sq + 200), sq + rng.choice([1, 63, 64, 65, 79, 113])])
        spec = replace(base, seqlen_q=sq, seqlen_k=sk)
        _, wl, wr, _, _ = FastSm90Forward.runtime_scalars(spec)
        m = rng.randrange(-(-(g * sq) // bm))
        first_q, offs = (m * bm) // g, sk - sq
        # key blocks around this tile's diagonal, and any block (a tail past seqlen_k included)
        diag = max(first_q + offs, 0) // bn
        # per query R intervals [lo, hi), empty or reversed ones among them
        lo = torch.randint(-50, sk + 50, (sq_max, max(nkr, 1)), generator=torch.Generator().manual_seed(sq))
        hi = lo + torch.randint(-20, 3 * bn, lo.shape, generator=torch.Generator().manual_seed(sk))
        kr = torch.stack([lo, hi], -1).to(torch.int32).contiguous()
        for n in {diag, diag + 1, max(diag - 1, 0), rng.randrange(-(-sk // bn) + 1)}:
            out = torch.full((bm, bn), 7.0)
            fn(ptr(out), ptr(kr, cutlass.Int32), m, n, g * sq, sk, wl, wr)
            q = torch.div(torch.arange(bm)[:, None] + m * bm, g, rounding_mode="floor")
            j = torch.arange(bn)[None, :] + n * bn
            seen = (j < sk).expand(bm, bn).clone()
            right = [b for b in ([0] if causal else []) + [window[1]] if b >= 0]
            if right:
                seen &= j <= q + offs + min(right)
            if window[0] >= 0:
                seen &= j >= q + offs - window[0]
            if nkr:
                qc = q.clamp(max=sq_max - 1)[:, 0]
                seen &= ((j[:, :, None] >= kr[qc, None, :, 0]) & (j[:, :, None] < kr[qc, None, :, 1])).any(-1)
                seen &= q < sq   # rows past the queries get no interval
            want = torch.where(seen, 1.0, float("-inf"))
            assert torch.equal(out, want), (sq, sk, m, n, (out != want).nonzero()[:5].tolist())


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d, causal", [(64, True), (128, False)])
def test_tile_info_leaves_the_decode_to_the_producer(d, causal, monkeypatch):
    """With FastSm90Forward.tile_info the producer warp decodes each tile's coordinates and the
    consumers read them from shared memory: the kernel's integer divisions by run-time values
    (PTX div / rem, each a dozen-plus SASS instructions) are then only the producer's and the
    slot bounds', at most 2/3 of those with every consumer thread decoding too."""
    import dualattn.fast.sm90 as sm90
    counts = {}
    for flag in ("0", "1"):
        monkeypatch.setattr(sm90, "_TILE_INFO_ENV", flag)
        spec = _spec(d, causal, sq=4096, sk=4096)
        assert FastSm90Forward.tile_info(spec) == (flag == "1")
        ptx = FastSm90Forward().compile_only(spec, arch=90).__ptx__
        counts[flag] = len(re.findall(r"^\s*(?:div|rem)\.[su]32", ptx, flags=re.M))
    assert counts["1"] <= 2 * counts["0"] // 3, counts


@pytest.mark.compile_only
@pytest.mark.timeout(300)
def test_phase_trace_is_a_separate_build_only_where_its_stamps_fit(monkeypatch):
    """The phase trace (ci/phase_trace.py) is off unless fast/sm90.TRACE_PHASES is set; then dense
    batched calls that return the LSE build with 5 clock stamps per consumer warpgroup and tile
    and 3 of the producer warp's (each reads %clock, %smid, %globaltimer_lo), under its own
    compile key; varlen, packed GQA rows, key ranges and calls without LSE never trace (their
    LSE rows are not the tile's)."""
    import dualattn.fast.sm90 as sm90
    spec = _spec(128, True, sq=2048, sk=2048, return_lse=True)
    assert not FastSm90Forward.trace_phases(spec)
    plain_key = FORWARD.compile_key(spec, 90)
    assert "%clock" not in FORWARD.compile_only(spec, arch=90).__ptx__
    monkeypatch.setattr(sm90, "TRACE_PHASES", True)
    assert FastSm90Forward.trace_phases(spec)
    assert FORWARD.compile_key(spec, 90) != plain_key
    ptx = FORWARD.compile_only(spec, arch=90).__ptx__
    assert ptx.count("%clock;") == 8 and ptx.count("%smid;") == 8 and ptx.count("%globaltimer_lo;") == 8
    never = [_spec(128, True, sq=2048, sk=2048, return_lse=False),
             _spec(128, True, sq=48, sk=2048, return_lse=True),
             _spec(128, True, sq=2048, sk=2048, num_key_ranges=1, return_lse=True)]
    assert FastSm90Forward.pack_gqa(never[1]) > 1
    assert not any(FastSm90Forward.trace_phases(s) for s in never)
