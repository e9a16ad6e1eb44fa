"""fast-sm90 A/B of two knob settings on given dense cells (GPU only): CUDA-graph replays of both
kernels, captured once each, timed interleaved in six rounds, the order turned every round
(medians; L2 flushed before each).

    python ci/sm90_env_ab.py A B CELL...
    python ci/sm90_env_ab.py "" "_STAGING_PER_TILE_ENV=0" 16,1024,16,128,0 4,4096,32,64,0

A and B: ';'-separated NAME=VALUE settings, NAME a module global of dualattn.fast.sm90 (the knobs'
``_..._ENV`` values, e.g. _PERSISTENT_ENV=1) or an environment variable read per call
(DUALATTN_SM90_TILES=256:64,2); "" is the default. CELL: batch,seqlen,heads,head_dim,causal (0/1),
query and key lengths equal or as Sq:Sk (e.g. 1,256:16384,32/8,128,1), or one of the bench's mask cells by name (window, docs, sparse), or a
causal sliding window as window:batch,seqlen,heads,head_dim,left (e.g. window:2,8192,16,128,1024),
or with ,right appended a non-causal window of both bounds; heads as 32/8 for GQA (dense or window),
or packed causal documents as docs:tokens,documents,heads,head_dim (bench.doc_lengths' lengths,
e.g. docs:32768,20,16,128 or docs:16384,10,16/4,128).
Prints each cell's TFLOP/s both ways and time B / time A (above 1: B is slower).
ci/sm90_grid_ab.py runs one knob over a fixed set of the bench's cells; this runs any two settings
over any cells."""
import os
import statistics
import sys
import warnings

import torch

import dualattn.fast.sm90 as sm90
from dualattn import bench as B


# the bench's mask cells by group name (window 1024 causal 16k, 10 documents 16k, block-sparse)
MASK_CELLS = {c.group: c for c in B.standard_matrix(("fwd",)) if c.group in ("window", "docs", "sparse")}


def apply(setting: str) -> None:
    for kv in filter(None, setting.split(";")):
        k, v = kv.split("=", 1)
        if k.startswith("_"):
            setattr(sm90, k, v)
        else:
            os.environ[k] = v


def clear(*settings: str) -> None:
    for kv in filter(None, ";".join(settings).split(";")):
        k = kv.split("=", 1)[0]
        if k.startswith("_"):
            setattr(sm90, k, "")
        else:
            os.environ.pop(k, None)


def parse_heads(field: str):
    """(query heads, KV heads) of a CELL's heads field: 16, or 32/8 for GQA."""
    heads_q, _, heads_kv = field.partition("/")
    return int(heads_q), int(heads_kv or heads_q)


def main(a: str, b: str, cells) -> None:
    warnings.filterwarnings("ignore")
    impl = sm90.FORWARD
    timer = B.Timer(warmup=3, reps=10)
    print(torch.cuda.get_device_name(0), flush=True)
    for text in cells:
        if text in MASK_CELLS:
            cell = MASK_CELLS[text]
        elif text.startswith("docs:"):
            tokens, docs, heads, head_dim = text[5:].split(",")
            heads_q, heads_kv = parse_heads(heads)
            cell = B.Cell("fwd", "docs", 1, int(tokens), int(tokens), heads_q, heads_kv, int(head_dim), True,
                          docs=int(docs))
        elif text.startswith("window:"):
            fields = text[7:].split(",")
            heads_q, heads_kv = parse_heads(fields[2])
            batch, seqlen, head_dim, left, *right = (int(x) for x in fields[:2] + fields[3:])
            cell = B.Cell("fwd", "window", batch, seqlen, seqlen, heads_q, heads_kv,
                          head_dim, not right, (left, right[0] if right else 0))
        else:
            fields = text.split(",")
            heads_q, heads_kv = parse_heads(fields[2])
            seqlen_q, _, seqlen_k = fields[1].partition(":")
            batch, head_dim, causal = (int(x) for x in fields[:1] + fields[3:])
            cell = B.Cell("fwd", "dense" if heads_q == heads_kv else "gqa", batch, int(seqlen_q),
                          int(seqlen_k or seqlen_q), heads_q, heads_kv, head_dim, causal=causal == 1)
        inp = B.make_inputs(cell)
        flops = B.work(cell)[0]
        graphs = {}
        for name, setting in (("A", a), ("B", b)):
            clear(a, b)
            apply(setting)
            impl._entries.clear()  # the launch memo would hand back the other setting's kernel
            runner = B.dualattn_runner(impl, inp, False)
            runner.fn()
            graphs[name] = B.cuda_graph_replay(runner.fn)
        clear(a, b)
        ms = {"A": [], "B": []}
        # A B, B A, ... : a fixed order read 1-2 % against the second on a cell whose two
        # settings run one kernel (docs section 49: 1.017-1.018, 1.001 with the order swapped)
        for r in range(6):
            for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
                ms[name].append(timer.time_ms(graphs[name])[0])
        ta, tb = statistics.median(ms["A"]), statistics.median(ms["B"])
        print(f"{text:22s} {cell.label():45s} A {flops / ta / 1e9:7.1f}  B {flops / tb / 1e9:7.1f} TFLOP/s  "
              f"time B/A {tb / ta:.3f}", flush=True)
        del inp, graphs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
