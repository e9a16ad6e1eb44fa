"""Where a fast-sm90 tile's time goes, per consumer warpgroup and phase (GPU only).

    python ci/phase_trace.py CELL...           # CELL: batch,seqlen,heads,head_dim,causal (0/1)
    python ci/phase_trace.py 16,1024,16,128,0 16,1024,16,128,1 --json out/

Each cell runs twice: the kernel as it is (30 timed calls), then a build with the phase trace
(fast/sm90.TRACE_PHASES; FlashFwdSm90.trace_phase), whose consumer warpgroups stamp the SM clock
at each phase of every tile into their LSE rows instead of the LSE. From the last traced call it
prints, in SM clock cycles (medians):

* the SM clock's rate over the run (cycles against the global timer), which NVML's reading in
  the bench's rows does not give;
* per warpgroup and key-block count: the wait for Q, the first block (Q K^T, mask, softmax), the
  rest of the blocks (each overlapped block and the last P V), the epilogue, and the gap to the
  next tile (the tile coordinates' hand-over);
* how far the second warpgroup runs behind the first (ping-pong wants half a block);
* the producer warp, against the first warpgroup's tile start: when it reached the tile, when it
  had Q's buffer and issued the Q load, when it had issued the tile's last K / V load (negative:
  before the consumers began the tile); and its time from a tile's last K / V to reaching the
  next tile on the same SM (p_between; listed under the earlier tile's key-block count).

The traced build's time is printed beside the plain one's: the stamps (one thread per warpgroup,
5 per tile) should not move it by more than a percent.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics

import torch

import dualattn
import dualattn.fast.sm90 as sm90
from dualattn import dispatch
from dualattn.fast.sm90.flash_fwd import TRACE_SLOTS
from dualattn.spec import AttentionSpec

WRAP = 1 << 24  # the stamps keep 24 bits (exact in fp32)
PHASES = ("q_wait", "first", "rest", "epilogue", "gap")
PRODUCER = ("p_start", "p_q_issued", "p_kv_issued")  # the producer's stamps (warpgroup 0's rows)
# and, from consecutive tiles of one SM, the TMA warp's time between a tile's last K / V and the
# next tile (docs section 34: the tile decode, 1200-2700 cycles, before the decoder warp)
PRODUCER_COLUMNS = PRODUCER + ("p_between",)


def _unwrap(values):
    if max(values) - min(values) > WRAP // 2:
        return [v + WRAP if v < WRAP // 2 else v for v in values]
    return values


def run_cell(batch, seqlen, heads, head_dim, causal):
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    times = {}
    lse = None
    for traced in (False, True):
        sm90.TRACE_PHASES = traced
        sm90.FORWARD._entries.clear()
        dispatch.LAUNCH_MEMO.clear()
        for _ in range(3):
            dualattn.attention(q, k, v, causal=causal, impl="fast", return_lse=True)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(30):
            _, lse = dualattn.attention(q, k, v, causal=causal, impl="fast", return_lse=True)
        stop.record()
        torch.cuda.synchronize()
        times["traced" if traced else "plain"] = start.elapsed_time(stop) / 30
    sm90.TRACE_PHASES = False
    spec = AttentionSpec("batched", batch, seqlen, seqlen, heads, heads, head_dim, head_dim,
                         torch.bfloat16, "cuda", causal=causal, return_lse=True)
    assert sm90.FastSm90Forward.trace_phases(spec) is False  # (the switch is off again)
    tile_m = sm90.FastSm90Forward.config(spec)[0]
    stamps = lse.float().cpu().numpy()
    rows = []
    for b in range(batch):
        for h in range(heads):
            for m in range(-(-seqlen // tile_m)):
                for wg in range(tile_m // 64):
                    row0 = m * tile_m + 64 * wg
                    if row0 + len(TRACE_SLOTS) <= seqlen:
                        s = {name: int(stamps[b, h, row0 + i]) for name, i in TRACE_SLOTS.items()}
                        rows.append(dict(tile=(b, h, m), wg=wg, **s))
    return times, rows


def analyse(rows):
    by_sm = collections.defaultdict(list)
    for r in rows:
        by_sm[(r["smid"], r["wg"])].append(r)
    phases = collections.defaultdict(lambda: collections.defaultdict(list))
    mhz = []
    clocks = ("start", "q_ready", "first_block", "last_pv", "end")
    for rs in by_sm.values():
        flat = iter(_unwrap([r[c] for r in rs for c in clocks]))
        for r in rs:
            r["t"] = [next(flat) for _ in clocks]
        rs.sort(key=lambda r: r["t"][0])
        gtime = _unwrap([r["gtime"] for r in rs])
        if len(rs) > 2 and gtime[-1] > gtime[0]:
            mhz.append((rs[-1]["t"][0] - rs[0]["t"][0]) / ((gtime[-1] - gtime[0]) * 32) * 1e3)
        for i, r in enumerate(rs):
            t0, t1, t2, t3, t4 = r["t"]
            p = phases[(r["wg"], r["n_blocks"])]
            p["q_wait"].append(t1 - t0)
            p["first"].append(t2 - t1)
            p["rest"].append(t3 - t2)
            p["epilogue"].append(t4 - t3)
            if i + 1 < len(rs):
                p["gap"].append(rs[i + 1]["t"][0] - t4)
                p["tile"].append(rs[i + 1]["t"][0] - t0)
            if r["wg"] == 0:
                for name in PRODUCER:  # signed, modulo the stamps' 24 bits
                    p[name].append((r[name] - r["start"] + WRAP // 2) % WRAP - WRAP // 2)
                if i + 1 < len(rs):
                    # the TMA warp's time from this tile's last K / V to reaching the next tile
                    # (without the decoder warp: the next tile's item_coords)
                    nxt = rs[i + 1]
                    p["p_between"].append((nxt["p_start"] - r["p_kv_issued"]) % WRAP)
    tiles = collections.defaultdict(dict)
    for r in rows:
        tiles[r["tile"]][r["wg"]] = r
    lag = [t[1]["t"][0] - t[0]["t"][0] for t in tiles.values()
           if 0 in t and 1 in t and t[0]["smid"] == t[1]["smid"]]
    return phases, mhz, lag


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cells", nargs="+")
    ap.add_argument("--json", help="folder for each cell's stamps")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(0), flush=True)
    med = statistics.median
    for cell in args.cells:
        batch, seqlen, heads, head_dim, causal = (int(x) for x in cell.split(","))
        times, rows = run_cell(batch, seqlen, heads, head_dim, causal == 1)
        if args.json:
            os.makedirs(args.json, exist_ok=True)
            with open(os.path.join(args.json, f"trace-{cell.replace(',', '-')}.json"), "w") as f:
                json.dump(dict(cell=cell, ms=times, rows=rows), f)
        phases, mhz, lag = analyse(rows)
        print(f"\n{cell}: plain {times['plain']:.4f} ms, traced {times['traced']:.4f} ms; SM clock "
              f"{med(mhz):.0f} MHz (min {min(mhz):.0f}, max {max(mhz):.0f}); warpgroup 1 starts a "
              f"tile {med(lag):.0f} cycles after warpgroup 0 (median)")
        print("  wg blocks tiles " + " ".join(f"{p:>8s}" for p in PHASES) + "     tile  rest/nb "
              + " ".join(f"{p:>11s}" for p in PRODUCER_COLUMNS))
        for (wg, nb), p in sorted(phases.items()):
            cols = " ".join(f"{med(p[k]):8.0f}" if p[k] else "       -" for k in PHASES)
            tile = med(p["tile"]) if p["tile"] else float("nan")
            rest = med(p["rest"]) / nb if nb else float("nan")
            prod = " ".join(f"{med(p[k]):11.0f}" if p[k] else "          -" for k in PRODUCER_COLUMNS)
            print(f"  {wg:2d} {nb:6d} {len(p['first']):5d} {cols} {tile:8.0f} {rest:8.0f} {prod}")


if __name__ == "__main__":
    main()
