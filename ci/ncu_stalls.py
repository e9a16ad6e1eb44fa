"""Warp-stall samples of a kernel's hot loop, from Nsight Compute's per-instruction source page
(a diagnosis tool; docs section 39). On the GPU machine:

    ncu --profile-from-start off --clock-control none --warp-sampling-interval 0 \
        --section SourceCounters --section WarpStateStats -o prof \
        python ci/ncu_cell.py --hdim 128 --seqlen 2k --causal no --impls fast-sm90
    ncu -i prof.ncu-rep --page source --csv --print-source sass > src.csv

then anywhere:

    python ci/ncu_stalls.py src.csv            # totals by stall reason and by opcode
    python ci/ncu_stalls.py src.csv --listing  # every hot instruction, its samples, top reasons

"Hot" instructions are those executed at least --hot times as often as the most executed one:
the steady key-block loop. Samples are taken per warp at a fixed interval, so an instruction's
samples over those of a plain one-cycle issue (about the median of its FMUL / FFMA lines) read
as cycles per execution.
"""
import argparse
import collections
import csv


def load(path):
    rows = list(csv.reader(open(path)))
    header = next(i for i, r in enumerate(rows) if "Source" in r and "# Samples" in r)
    hdr, data = rows[header], rows[header + 1:]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in data:
        src = r[ix["Source"]].strip()
        words = src.split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
        out.append({"src": src, "op": op.split(".")[0], "exec": int(r[ix["Instructions Executed"]] or 0),
                    "samples": int(r[ix["# Samples"]] or 0),
                    "reasons": {h[6:]: int(r[ix[h]] or 0) for h in reasons}})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--hot", type=float, default=0.3, help="share of the top execution count")
    ap.add_argument("--listing", action="store_true")
    a = ap.parse_args()
    rows = load(a.csv)
    top = max(r["exec"] for r in rows)
    hot = [r for r in rows if r["exec"] >= a.hot * top]
    total = sum(r["samples"] for r in rows)
    loop = sum(r["samples"] for r in hot)
    print(f"samples: {total} in the kernel, {loop} in {len(hot)} hot instructions")
    by_reason, by_op = collections.Counter(), collections.defaultdict(collections.Counter)
    for r in hot:
        by_reason.update(r["reasons"])
        by_op[r["op"]].update(r["reasons"])
    print("hot loop by reason:", ", ".join(f"{k} {v / loop:.3f}" for k, v in by_reason.most_common(8)))
    one_issue = sorted(r["samples"] for r in hot if r["op"] in ("FMUL", "FFMA"))
    if one_issue:
        print(f"one issue ~ {one_issue[len(one_issue) // 2]} samples (median FMUL / FFMA line)")
    for op, c in sorted(by_op.items(), key=lambda kv: -sum(kv[1].values()))[:16]:
        n = sum(c.values())
        print(f"  {op:12s} {n:8d} {n / loop:.3f}  " + ", ".join(f"{k} {v}" for k, v in c.most_common(4)))
    if a.listing:
        for r in hot:
            reasons = sorted(((v, k) for k, v in r["reasons"].items() if v), reverse=True)[:3]
            print(f"{r['samples']:7d}  {r['src'][:64]:64s} " + " ".join(f"{k}:{v}" for v, k in reasons))


if __name__ == "__main__":
    main()
