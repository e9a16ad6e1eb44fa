"""dualattn.bench: the matrix, useful-FLOP counts, the runners (on CPU with the oracle and a fake
timer), the report formats, and the CLI's refusal without CUDA."""
import json
import subprocess
import sys

import pytest
import torch

from dualattn import bench
from dualattn.bench import Cell
from dualattn.masks import element_visible


def test_cli_without_cuda_says_so_and_fails(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc = bench.main(["--quick"])
    err = capsys.readouterr().err
    assert rc != 0 and "needs a CUDA GPU" in err


def test_module_cli_exit_code_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    p = subprocess.run([sys.executable, "-m", "dualattn.bench", "--quick"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr


def test_list_matrix(capsys):
    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "150 cells" in out
    assert bench.main(["--list", "--quick", "--kind", "decode"]) == 0
    assert "2 cells" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--list", "--kind", "sideways"])
    with pytest.raises(SystemExit):
        bench.main(["--list", "--peers", "cudnn,bogus"])
    assert bench.main(["--list", "--hdim", "64", "--seqlen", "16k", "--kind", "fwd", "--causal", "yes"]) == 0
    assert "1 cells" in capsys.readouterr().out


def test_standard_matrix_shape():
    cells = bench.standard_matrix()
    dense = [c for c in cells if c.group == "dense"]
    assert {c.head_dim for c in dense} == {64, 128, 256}
    for c in dense:  # tokens = 16k, heads x dim = 2048
        assert c.batch * c.seqlen_q == 16384 and c.heads_q * c.head_dim == 2048
    assert {c.kind for c in cells} == set(bench.KINDS)
    dec = [c for c in cells if c.kind == "decode"]
    assert {c.seqlen_k for c in dec} == {8192, 16384, 32768, 65536, 131072} and {c.batch for c in dec} == {1, 8, 64}
    assert all(c.seqlen_q == 1 for c in dec)
    chunk = [c for c in cells if c.group == "chunk"]  # batch 1 against a long context, forward only
    assert chunk and all(c.kind == "fwd" and c.batch == 1 and c.seqlen_q < c.seqlen_k >= 16384 for c in chunk)
    assert "kv32k" in chunk[0].label() and "kv" not in dense[0].label()
    filt = bench.filter_cells(cells, head_dims=[128], seqlens=[16384], causal=True)
    assert filt and all(c.head_dim == 128 and c.causal for c in filt if c.kind != "decode")


def _brute_pairs(cell):
    rows, cols = torch.arange(cell.seqlen_q), torch.arange(cell.seqlen_k)
    vis = element_visible(rows, cols, cell.seqlen_q, cell.seqlen_k, causal=cell.causal, window=cell.window)
    return int(vis.expand(cell.seqlen_q, cell.seqlen_k).sum()) * cell.batch * cell.heads_q


@pytest.mark.parametrize("cell", [
    Cell("fwd", "dense", 2, 64, 64, 3, 3, 16, False),
    Cell("fwd", "dense", 2, 64, 64, 3, 3, 16, True),
    Cell("fwd", "dense", 1, 40, 72, 2, 1, 16, True),        # Sq != Sk: bottom-right
    Cell("fwd", "chunk", 1, 16, 300, 4, 2, 16, True),
    Cell("fwd", "window", 1, 96, 96, 2, 2, 16, True, (10, 0)),
    Cell("fwd", "window", 1, 50, 80, 2, 2, 16, False, (7, 3)),
])
def test_visible_pairs_match_the_predicate(cell):
    assert bench.visible_pairs(cell) == _brute_pairs(cell)


def test_visible_pairs_docs_and_sparse():
    c = Cell("fwd", "docs", 1, 100, 100, 2, 2, 16, True, docs=3)
    lens = bench.doc_lengths(100, 3)
    assert sum(lens) == 100 and len(lens) == 3 and len(set(lens)) > 1
    assert bench.visible_pairs(c) == 2 * sum(n * (n + 1) // 2 for n in lens)
    s = Cell("fwd", "sparse", 2, 512, 512, 2, 2, 16, density=0.25)
    st = bench.sparse_states(s)
    assert st.shape == (1, 1, 4, 4) and bool((st[0, 0].diagonal() > 0).all())
    assert bench.visible_pairs(s) == int((st > 0).sum()) * 128 * 128 * 2 * 2
    fl, unit = bench.work(Cell("fwdbwd", "dense", 1, 64, 64, 1, 1, 16))
    assert unit == "TFLOP/s" and fl == 3.5 * 4 * 64 * 64 * 16
    by, unit = bench.work(Cell("decode", "decode", 2, 1, 1000, 4, 2, 16))
    assert unit == "TB/s" and by == 2 * 1000 * 2 * 2 * 16 * 2


class FakeTimer:
    def warm(self, fn):
        fn()
        return 1e-3

    def time_interleaved(self, fns, warm=True, seconds=None):
        for fn in fns:
            fn()
        return [(1.0, 1)] * len(fns)


class RecordingTimer(bench.Timer):
    """bench.Timer's rounds on the CPU: each timed run records who ran and returns a time."""

    def __init__(self, reps, times):
        self.warmup, self.reps, self.budget_s, self.rehearse = 1, reps, 1e9, False
        self.order, self.times = [], times

    def timed_run(self, fn):
        name = fn()
        self.order.append(name)
        t = self.times[name]
        return t(len([o for o in self.order if o == name])) if callable(t) else t


def test_interleaved_rounds_rotate_and_share_the_clock():
    """Every function runs once per round, in a rotated order (no function always first or last,
    each sees the same drift of the clock); medians per function; one that raises is dropped from
    the later rounds and reported, the others go on."""
    drift = lambda k: 1.0 + 0.1 * k  # the GPU slows down round by round
    timer = RecordingTimer(reps=6, times={"a": drift, "b": lambda k: 2 * drift(k), "c": 3.0})
    fns = [lambda: "a", lambda: "b", lambda: "c"]
    out = timer.time_interleaved(fns, warm=False, seconds=[1.0, 1.0, 1.0])
    assert [reps for _, reps in out] == [6, 6, 6]
    rounds = [timer.order[3 * r:3 * r + 3] for r in range(6)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert {r[0] for r in rounds} == {"a", "b", "c"} and {r[-1] for r in rounds} == {"a", "b", "c"}
    assert out[1][0] == pytest.approx(2 * out[0][0]) and out[2][0] == 3.0  # drift cancels in the ratio

    calls = {"n": 0}

    def breaks():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("kaput")
        return "b"
    timer = RecordingTimer(reps=5, times={"a": 1.0, "b": 2.0})
    out = timer.time_interleaved([lambda: "a", breaks], warm=False, seconds=[1.0, 1.0])
    assert out[0] == (1.0, 5)
    assert isinstance(out[1][0], RuntimeError) and out[1][1] == 1 and calls["n"] == 2
    # the budget bounds the rounds: three at least, however slow the functions
    timer = RecordingTimer(reps=20, times={"a": 1.0})
    timer.budget_s = 0.5
    assert timer.time_interleaved([lambda: "a"], warm=False, seconds=[10.0]) == [(1.0, 3)]


TINY = [
    Cell("fwd", "dense", 2, 32, 32, 2, 2, 16, True, dtype="float32"),
    Cell("bwd", "gqa", 1, 32, 32, 4, 2, 16, True, dtype="float32"),
    Cell("fwdbwd", "window", 1, 48, 48, 2, 2, 16, True, (8, 0), dtype="float32"),
    Cell("fwd", "docs", 1, 40, 40, 2, 2, 16, True, docs=3, dtype="float32"),
    Cell("fwd", "sparse", 1, 256, 256, 2, 2, 16, density=0.3, dtype="float32"),
    Cell("decode", "decode", 2, 1, 64, 4, 2, 16, dtype="float32"),
]


def test_run_matrix_on_cpu_with_the_oracle(tmp_path):
    impls = bench.select_impls(["torch"])
    results = bench.run_matrix(TINY, impls, [], FakeTimer(), device="cpu")
    rows = len(TINY) + sum(bench.has_csr_form(c) for c in TINY)  # docs / window: a +csr row too
    assert len(results) == rows
    for r in results:
        assert r.status == "ok", (r.cell.label(), r.status)
        assert r.ms == 1.0 and r.rate == pytest.approx(bench.work(r.cell)[0] / 1e-3 / 1e12)
    # the forward output of the runner is the oracle's
    fwd = bench.dualattn_runner(impls[0], bench.make_inputs(TINY[0], "cpu"))
    inp = bench.make_inputs(TINY[0], "cpu")
    import dualattn
    torch.testing.assert_close(fwd.out(), dualattn.attention(inp.q, inp.k, inp.v, causal=True, impl="torch"))
    # reports
    table = bench.format_table(results, ["cudnn", "fa4"])
    assert "vs cudnn" in table and "torch" in table and TINY[3].label() in table
    path = tmp_path / "r.json"
    bench.write_json(str(path), results, {"device": "cpu"})
    data = json.loads(path.read_text())
    assert data["meta"]["device"] == "cpu" and len(data["results"]) == rows
    assert data["results"][0]["cell"]["label"] == TINY[0].label()


def test_not_applicable_and_errors_are_reported():
    class Refuses:
        name, family = "refuses", "triton"

        def can_implement(self, spec):
            return "no thanks"

    class Breaks:
        name, family = "breaks", "triton"

        def can_implement(self, spec):
            return None

        def forward(self, call):
            raise RuntimeError("kaput")

    res = bench.run_matrix(TINY[:1], [Refuses(), Breaks()], [], FakeTimer(), device="cpu")
    assert res[0].status == "n/a: no thanks"
    assert res[1].status.startswith("error: RuntimeError: kaput")
    table = bench.format_table(res, [])
    assert "n/a: no thanks" in table and "kaput" in table


def test_ratio_column():
    c = TINY[0]
    rs = [bench.Result(c, "cudnn", True, ms=2.0, rate=1.0, unit="TFLOP/s"),
          bench.Result(c, "fast-x", False, ms=1.0, rate=2.0, unit="TFLOP/s")]
    line = [l for l in bench.format_table(rs, ["cudnn"]).splitlines() if "fast-x" in l][0]
    assert "2.00x" in line


def test_sdpa_peer_refuses_masks_it_lacks():
    with pytest.raises(bench.NotApplicable, match="window"):
        bench.sdpa_runner("cudnn", bench.make_inputs(TINY[2], "cpu"))
    with pytest.raises(bench.NotApplicable, match="varlen"):
        bench.sdpa_runner("fa2", bench.make_inputs(TINY[3], "cpu"))


def test_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (optional extra)")
    results = bench.run_matrix(TINY, bench.select_impls(["torch"]), [], FakeTimer(), device="cpu")
    results.append(bench.Result(TINY[0], "cudnn", True, ms=0.5, rate=3.0, unit="TFLOP/s"))
    out = tmp_path / "b.png"
    bench.plot(results, str(out))
    assert out.stat().st_size > 10_000


def test_autograd_peer_runner_paths_on_cpu():
    """The SDPA runner (math backend on CPU) through fwd / bwd / fwd+bwd / decode, next to the oracle:
    the forward outputs agree (maxdiff) and the backward runs produce gradients of the right shapes."""
    cells = [TINY[0], TINY[1], Cell("fwdbwd", "dense", 1, 32, 32, 2, 2, 16, True, dtype="float32"), TINY[5]]
    rows = []
    res = bench.run_matrix(cells, bench.select_impls(["torch"]), ["sdpa-math"], FakeTimer(), device="cpu",
                           on_result=lambda r, c: rows.append(bench.format_row(r, ["sdpa-math"], c)))
    assert all(r.status == "ok" for r in res), [(r.impl, r.status) for r in res]
    fwd_oracle = [r for r in res if not r.peer and r.cell.kind in ("fwd", "decode")]
    assert all(r.maxdiff is not None and r.maxdiff < 1e-5 for r in fwd_oracle)
    assert len(rows) == len(res) and "1.00x" in rows[1]
    inp = bench.make_inputs(TINY[1], "cpu")
    grads = bench.peer_runner("sdpa-math", inp).fn()
    assert [g.shape for g in grads] == [inp.q.shape, inp.k.shape, inp.v.shape]


def test_replot_from_json(tmp_path):
    """A GPU machine without matplotlib writes --json; --replot draws it elsewhere, same results."""
    pytest.importorskip("matplotlib", reason="matplotlib not installed (optional extra)")
    results = bench.run_matrix(TINY, bench.select_impls(["torch"]), [], FakeTimer(), device="cpu")
    path = tmp_path / "r.json"
    bench.write_json(str(path), results, {"device": "cpu"})
    loaded = bench.load_results(str(path))
    assert [(r.cell, r.impl, r.rate) for r in loaded] == [(r.cell, r.impl, r.rate) for r in results]
    gz = tmp_path / "r.json.gz"  # the form kept under docs/
    bench.write_json(str(gz), results, {"device": "cpu"})
    assert gz.read_bytes()[:2] == b"\x1f\x8b"
    assert [(r.cell, r.impl, r.rate) for r in bench.load_results(str(gz))] == \
        [(r.cell, r.impl, r.rate) for r in results]
    out = tmp_path / "r.png"
    assert bench.main(["--replot", str(path), "--plot", str(out)]) == 0
    assert out.stat().st_size > 10_000


def test_csr_rows_of_docs_and_window_cells_match_the_plain_call():
    """``<impl>+csr`` runs the docs / window cell as one batched call with an exact CSR: the
    same attention, so its forward output matches the plain (varlen / window) call's."""
    cells = [Cell("fwd", "window", 1, 300, 300, 2, 2, 16, True, (40, 0), dtype="float32"),
             Cell("fwd", "docs", 1, 300, 300, 2, 2, 16, True, docs=3, dtype="float32"),
             Cell("fwd", "dense", 1, 64, 64, 2, 2, 16, True, dtype="float32")]
    res = bench.run_matrix(cells, bench.select_impls(["torch"]), [], FakeTimer(), device="cpu")
    csr = [r for r in res if r.impl == "torch" + bench.CSR]
    assert [r.cell for r in csr] == cells[:2]  # the dense cell has no CSR form
    for r in csr:
        assert r.status == "ok", r.status
        assert r.maxdiff is not None and r.maxdiff < 1e-5, (r.cell.label(), r.maxdiff)
    assert "torch+csr" in bench.format_table(res, [])


def test_graph_flag_parses_and_adds_no_rows_without_a_gpu():
    """--graph asks for CUDA-graph rows beside every eager row; without CUDA there are none."""
    assert bench.build_parser().parse_args(["--graph"]).graph
    assert not bench.build_parser().parse_args([]).graph
    results = bench.run_matrix(TINY, bench.select_impls(["torch"]), [], FakeTimer(), device="cpu", graph=True)
    assert results and not any(r.impl.endswith(bench.GRAPH) for r in results)
