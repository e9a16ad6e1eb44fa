"""Block model of the mask cells' share of dense (CPU): what the bench's window and documents
cells (hd128, 16k, causal; 128 x 128 tiles) can reach against dense causal 16k when every tile
costs its visited key blocks plus a fixed cost of C key blocks (its start, last P V and epilogue;
ci/tile_cost_probe.py fits 1.42 at hd128, the phase trace ~1.7). A visit is counted per 64-row
warpgroup, whole blocks except the halves narrow_first (the diagonal's block) and narrow_last
(the left window edge's block) skip; the element masks' own cost is left out, so the shares are
upper bounds of the model.

    python ci/mask_share_model.py [C ...]
"""
import sys

from dualattn.bench import doc_lengths

BM, BN, WG_ROWS, SEQ, WINDOW = 128, 128, 64, 16384, 1024


def warpgroup_visit(lo_key, hi_key):
    """Key blocks (in units of BN) one warpgroup visits for keys [lo_key, hi_key] seen by its rows:
    whole blocks, but an edge block whose half it does not need counts half."""
    lo_block, hi_block = lo_key // BN, hi_key // BN
    blocks = hi_block - lo_block + 1
    if hi_key % BN < BN // 2:  # the diagonal's block: lower half only (narrow_first)
        blocks -= 0.5
    if lo_key % BN >= BN // 2:  # the left edge's block: upper half only (narrow_last)
        blocks -= 0.5
    return blocks


def tiles(rows, lo_of_row):
    """(visited blocks, visible pairs / BN^2) per 128-row tile of one sequence of ``rows`` rows
    whose row r sees keys [lo_of_row(r), r]."""
    out = []
    for m in range(-(-rows // BM)):
        visited, pairs = 0.0, 0
        for w in range(BM // WG_ROWS):
            r0, r1 = m * BM + w * WG_ROWS, min(m * BM + (w + 1) * WG_ROWS, rows) - 1
            if r0 > r1:
                continue
            visited += warpgroup_visit(lo_of_row(r0), r1) / (BM // WG_ROWS)
            pairs += sum(r - lo_of_row(r) + 1 for r in range(r0, r1 + 1))
        out.append((visited, pairs / (BM * BN)))
    return out


def rate(ts, fixed):
    return sum(p for _, p in ts) / sum(v + fixed for v, _ in ts)


def main(argv):
    dense = tiles(SEQ, lambda r: 0)
    window = tiles(SEQ, lambda r: max(0, r - WINDOW))
    docs = [t for n in doc_lengths(SEQ, 10) for t in tiles(n, lambda r: 0)]
    for fixed in [float(c) for c in argv] or [0.0, 0.6, 1.0, 1.42, 1.7]:
        d = rate(dense, fixed)
        print(f"tile cost {fixed:4.2f} blocks: dense {d:.3f} of the tiles' peak, window share "
              f"{rate(window, fixed) / d:.3f}, documents share {rate(docs, fixed) / d:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
