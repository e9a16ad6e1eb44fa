"""Do one warpgroup's CUDA-core instructions slow down while another warpgroup's wgmma GEMMs run?

    python ci/tensor_alu_probe.py [--workload softmax|nomufu|mufu] [--gemm SS,RS] [--modes 0,1] [--acc f32|f16]
                                  [--reps-alu 16] [--iters-gemm 0] [--launches 9]   (H100 / H200)
    python ci/tensor_alu_probe.py --compile-only     (no GPU: builds for sm_90a, counts PTX ops)

Why (docs/bench-h100-20261124.md, sections 37-39): in fast-sm90's hd128 steady loop one
warpgroup's softmax (FMNMX / FFMA / MUFU.EX2 on 64 fp32 scores a thread) takes ~1640 clocks when
it runs beside the other warpgroup's wgmma GEMMs but ~1150 when the tensor cores are idle, and
section 39's stall samples give "dispatch" 13 % of the loop. One guess: the wgmma accumulators'
register-file traffic (read and written by the tensor core on the same sub-partitions) takes
register-file ports the ALU instructions then wait for. This probe isolates that.

Kernel: one CTA per SM, 256 threads. Warpgroup 0 ("gemm"), when the run-time flag gemm_on is set,
loops iters_gemm times over a 64x128x128 bf16 GEMM into a 64x128 fp32 accumulator (64 registers a
thread): fence, 8 wgmma m64n128k16, commit, wait(0); A and B from shared memory (SS, as Q K^T) or
A from registers (RS, as P V), both built and run. Warpgroup 1 ("alu") runs reps_alu rounds of a
softmax on 64 fp32 registers laid out like the kernel's S (2 rows x 32 columns a thread): row max
in 4 FMNMX chains + 2 quad shuffles, the correction exp2, 64 FFMA + 64 MUFU.EX2 (ex2.approx.ftz),
the row sum in 4 FADD chains; the exponentials feed the next round. Both start after one CTA
barrier; every warp's lane 0 stores %clock64 at its start and end. Warp w runs on sub-partition
w % 4, so each sub-partition holds one GEMM warp and one ALU warp, as with the kernel's two
consumer warpgroups. The accumulator and the softmax results are summed into a sink tensor after
the timed regions, so neither can be dropped.

Printed, per mode (SS and RS GEMM; gemm off / on): the median over SMs, warps and launches of the
ALU warps' cycles (total and per softmax round), the GEMM warps' loop cycles (and tensor clocks
per chain: 512 is the dense peak for 64x128x128), the ratio on/off, how many cycles after its
SM's ALU warps the first GEMM warp starts its loop (median; H200: 56 SS, 191 RS, the accumulator's
zeroing and RS's operand moves land after the barrier) and the share of ALU warps that end
before their SM's last GEMM warp does (should be 100 %; else raise --iters-gemm). The ALU window
also holds the scores' initialisation (~70 instructions, once; ptxas sinks it past the barrier),
the same in both modes.

H200, 2026-11-26 (docs section 39), cycles a round with the GEMMs off -> on: softmax SS 745 ->
1173 (1.57x), RS 756 -> 1082 (1.43x); without MUFU (--workload nomufu) SS 366 -> 648 (1.77x), RS
381 -> 663 (1.74x); exponentials and sums only (--workload mufu) SS 582 -> 819 (1.41x), RS 587 ->
766 (1.31x); GEMM 580-609 cycles a chain. Controls (--modes 0,1,2,3), the softmax: warpgroup 0
resident but blocked at a barrier 0.996-0.997x, running 8 FFMA chains 1.18-1.21x, GEMMs 1.50-1.52x.
With an fp16 accumulator (--acc f16, half the registers, same chain time) the GEMMs cost the
softmax 1.15-1.23x and fp32 work 1.18-1.21x: the slowdown follows the accumulator's traffic.
"""
import argparse
import statistics
import sys
import tempfile

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

M, N, K = 64, 128, 128    # one chain: the hd128 kernel's Q K^T (or P V) of one warpgroup
THREADS = 256
WARPS = THREADS // 32


def softmax_round(s, row_max, row_sum, scale, workload="softmax"):
    """One softmax round on the 64 registers of s (2 rows x 32), unrolled at trace time (a plain
    function: the DSL does not rewrite its loops). ``workload``: "softmax" (all of it), "nomufu"
    (the exponentials replaced by their FFMA alone), "mufu" (no row max: exponentials and sums)."""
    exp2 = (lambda x: x) if workload == "nomufu" else (lambda x: cute.math.exp2(x, fastmath=True))
    for r in range(2):
        v = [s[r * 32 + j] for j in range(32)]
        if workload == "mufu":
            m_off = row_max[r] * scale
            sums = [Float32(0.0)] * 4
            for j in range(32):
                p = exp2(v[j] * scale - m_off)
                sums[j % 4] = sums[j % 4] + p
                s[r * 32 + j] = p
            row_sum[r] = row_sum[r] + ((sums[0] + sums[1]) + (sums[2] + sums[3]))
            continue
        chains = []
        for c in range(4):                            # 4 independent FMNMX chains of 8
            m = v[c * 8]
            for j in range(1, 8):
                m = cute.arch.fmax(m, v[c * 8 + j])
            chains.append(m)
        m = cute.arch.fmax(cute.arch.fmax(chains[0], chains[1]), cute.arch.fmax(chains[2], chains[3]))
        m = cute.arch.fmax(m, row_max[r])
        for off in (2, 1):                            # the row's 4 threads of a quad
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=off))
        m_off = m * scale
        corr = exp2(row_max[r] * scale - m_off)
        sums = [Float32(0.0)] * 4
        for j in range(32):                           # FFMA + MUFU.EX2, 4 FADD chains
            p = exp2(v[j] * scale - m_off)
            sums[j % 4] = sums[j % 4] + p
            s[r * 32 + j] = p
        row_sum[r] = row_sum[r] * corr + ((sums[0] + sums[1]) + (sums[2] + sums[3]))
        row_max[r] = m


class Probe:
    def __init__(self, rs: bool, workload: str = "softmax", acc16: bool = False):
        self.rs = rs  # A operand from registers (as P V does) instead of shared memory
        # fp16 operands with an fp16 accumulator (32 registers a thread instead of 64): whether
        # the slowdown follows the accumulator's register traffic
        self.acc16 = acc16
        self.ab = Float16 if acc16 else BFloat16
        self.acc = Float16 if acc16 else Float32
        self.workload = workload  # the ALU warps' instructions (softmax_round)

    def _smem_layout(self, shape):
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.ab, shape[1]), self.ab)
        return cute.tile_to_shape(atom, shape, order=(0, 1))

    @cute.jit
    def __call__(self, p_stamps: cute.Pointer, p_sink: cute.Pointer, grid: Int32, gemm_on: Int32,
                 iters_gemm: Int32, reps_alu: Int32, scale: Float32, stream):
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab, self.ab, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            self.acc, atom_layout_mnk=(1, 1, 1), tiler_mn=(M, N),
            a_source=warpgroup.OperandSource.RMEM if const_expr(self.rs) else warpgroup.OperandSource.SMEM)
        sA_layout, sB_layout = self._smem_layout((M, K)), self._smem_layout((N, K))

        @cute.struct
        class Storage:
            sA: cute.struct.Align[cute.struct.MemRange[self.ab, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab, cute.cosize(sB_layout)], 1024]

        self.storage = Storage
        # stamps: (SM's CTA, warp, start / end) clock64; sink: one fp32 per thread
        stamps = cute.make_tensor(p_stamps, cute.make_layout((grid, WARPS, 2), stride=(WARPS * 2, 2, 1)))
        sink = cute.make_tensor(p_sink, cute.make_layout((grid, THREADS), stride=(THREADS, 1)))
        self.kernel(tiled_mma, sA_layout, sB_layout, stamps, sink, gemm_on, iters_gemm, reps_alu,
                    scale).launch(grid=(grid, 1, 1), block=(THREADS, 1, 1), stream=stream,
                                  min_blocks_per_mp=1, smem=Storage.size_in_bytes())

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, stamps: cute.Tensor, sink: cute.Tensor,
               gemm_on: Int32, iters_gemm: Int32, reps_alu: Int32, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        # operands: small values from the index (no NaN / inf), written by all threads
        flatA = storage.sA.get_tensor(cute.make_layout(M * K))
        flatB = storage.sB.get_tensor(cute.make_layout(N * K))
        for i in cutlass.range(tidx, M * K, THREADS, unroll=1):
            flatA[i] = self.ab(Float32((i % 13) - 6) * Float32(0.0625))
        for i in cutlass.range(tidx, N * K, THREADS, unroll=1):
            flatB[i] = self.ab(Float32((i % 11) - 5) * Float32(0.0625))
        cute.arch.fence_proxy("async.shared", space="cta")  # generic stores -> wgmma reads
        cute.arch.barrier()

        if warp < 4:
            # ---- warpgroup 0: wgmma chains ----
            thr_mma = tiled_mma.get_slice(tidx)
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((M, N)), self.acc)
            acc.fill(0.0)
            tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB))
            if const_expr(self.rs):
                tCrA = cute.make_rmem_tensor_like(thr_mma.partition_A(sA), self.ab)
                tCrA.store(thr_mma.partition_A(sA).load())
            else:
                tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA))
            atom = cute.make_mma_atom(tiled_mma.op)
            atom.set(warpgroup.Field.ACCUMULATE, True)
            cute.arch.barrier()                       # both warpgroups start here
            t0 = cute.arch.clock64()
            if gemm_on == 1:
                for _ in cutlass.range(iters_gemm, unroll=1):
                    warpgroup.fence()
                    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
                        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
            elif gemm_on == 2:
                # resident but idle: blocked at a named barrier until the ALU warps are done
                cute.arch.barrier(barrier_id=1, number_of_threads=THREADS)
            elif gemm_on == 3:
                # busy on the CUDA cores instead: 8 independent FFMA chains on the accumulator
                for _ in cutlass.range(iters_gemm * 64, unroll=1):
                    for i in cutlass.range_constexpr(8):
                        acc[i] = self.acc(Float32(acc[i]) * Float32(0.999) + Float32(0.001))
            t1 = cute.arch.clock64()
            if lane == 0:
                stamps[bidx, warp, 0] = t0
                stamps[bidx, warp, 1] = t1
            sink[bidx, tidx] = acc.load().to(Float32).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        else:
            # ---- warpgroup 1: a softmax on 64 fp32 registers, 2 rows x 32 columns ----
            s = cute.make_rmem_tensor(64, Float32)
            base = Float32(tidx) * Float32(0.01)
            for i in cutlass.range_constexpr(64):
                s[i] = base + Float32(i * 0.03125)
            row_max = cute.make_rmem_tensor(2, Float32)
            row_sum = cute.make_rmem_tensor(2, Float32)
            row_max.fill(-1.0e30)
            row_sum.fill(0.0)
            cute.arch.barrier()                       # both warpgroups start here
            t0 = cute.arch.clock64()
            for _ in cutlass.range(reps_alu, unroll=1):
                softmax_round(s, row_max, row_sum, scale, self.workload)
            t1 = cute.arch.clock64()
            if gemm_on == 2:
                cute.arch.barrier_arrive(barrier_id=1, number_of_threads=THREADS)
            if lane == 0:
                stamps[bidx, warp, 0] = t0
                stamps[bidx, warp, 1] = t1
            sink[bidx, tidx] = row_sum[0] + row_sum[1] + s[0] + s[63]


def compile_probe(rs: bool, arch: str, keep_ptx_dir=None, workload="softmax", acc16=False):
    import cuda.bindings.driver as cuda
    ptr = lambda dt: cute.runtime.make_ptr(dt, 1 << 20, cute.AddressSpace.gmem, assumed_align=16)
    opts = f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir {keep_ptx_dir}" if keep_ptx_dir else "")
    return cute.compile(Probe(rs, workload, acc16), ptr(Int64), ptr(Float32), Int32(1), Int32(1), Int32(1), Int32(1),
                        Float32(1.0), cuda.CUstream(0), options=opts)


def sass_summary(ptx: str, d: str) -> str:
    """ptxas's register / spill report and SASS op counts (fast/sm90/sass: Triton's ptxas and
    cuobjdump)."""
    from dualattn.fast.sm90.sass import assemble, opcode
    log, sass = assemble(ptx, d)
    info = "; ".join(ln.split(":")[-1].strip() for ln in log.splitlines()
                     if "registers" in ln or "spill" in ln)
    ops = ("HGMMA", "MUFU.EX2", "FMNMX")
    return f"SASS {info}; " + ", ".join(
        f"{k} x{sum(opcode(ln).startswith(k) for ln in sass)}" for k in ops) + \
        f", clock reads x{sum('SR_CLOCKLO' in ln for ln in sass)} (HGMMA: ptxas unrolls the chain loop)"


def compile_only(workload="softmax", acc16=False):
    for rs in (False, True):
        with tempfile.TemporaryDirectory(prefix="tensor-alu-probe-") as d:
            ptx = compile_probe(rs, "sm_90a", d, workload, acc16).__ptx__
            ops = ("wgmma.mma_async", "ex2.approx", "max.f32", "wgmma.wait_group", "%clock64")
            print(f"{'RS' if rs else 'SS'}: PTX {len(ptx)} chars; "
                  + ", ".join(f"{k} x{ptx.count(k)}" for k in ops))
            print(f"    {sass_summary(ptx, d)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--reps-alu", type=int, default=16, help="softmax rounds timed per ALU warp")
    ap.add_argument("--iters-gemm", type=int, default=0, help="GEMM chains (0: 4x reps-alu + 16)")
    ap.add_argument("--launches", type=int, default=9)
    ap.add_argument("--workload", default="softmax", choices=("softmax", "nomufu", "mufu"),
                    help="the ALU warps' work: the whole softmax, without MUFU, or MUFU without the max")
    ap.add_argument("--gemm", default="SS,RS", help="GEMM forms to run: SS, RS or both")
    ap.add_argument("--acc", default="f32", choices=("f32", "f16"),
                    help="the GEMM's accumulator: fp32 with bf16 operands, or fp16 with fp16 operands")
    ap.add_argument("--modes", default="0,1", help="warpgroup 0's modes: 0 exits, 1 wgmma GEMMs, "
                    "2 resident but blocked at a barrier, 3 8 FFMA chains (busy CUDA cores)")
    a = ap.parse_args()
    if a.compile_only:
        return compile_only(a.workload, a.acc == "f16")
    import torch
    import cuda.bindings.driver as cuda
    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) != (9, 0):
        sys.exit(f"needs an sm_90 GPU, found sm_{major}{minor}")
    iters = a.iters_gemm or 4 * a.reps_alu + 16
    stamps = torch.zeros(sms, WARPS, 2, dtype=torch.int64, device="cuda")
    sink = torch.zeros(sms, THREADS, dtype=torch.float32, device="cuda")
    ptr = lambda t, dt: cute.runtime.make_ptr(dt, t.data_ptr(), cute.AddressSpace.gmem, assumed_align=16)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    print(f"# {torch.cuda.get_device_name(dev)}, {sms} SMs; workload {a.workload}; {a.acc} accumulator; reps_alu {a.reps_alu}, iters_gemm {iters}, "
          f"{a.launches} launches a mode (first discarded); cycles are %clock64 (SM clocks)")
    for rs in [form == "RS" for form in a.gemm.split(",")]:
        fn = compile_probe(rs, "sm_90a", workload=a.workload, acc16=a.acc == "f16")
        res = {}
        for on in [int(m) for m in a.modes.split(",")]:
            alu, gemm, lag, inside = [], [], [], []
            for launch in range(a.launches + 1):
                fn(ptr(stamps, Int64), ptr(sink, Float32), Int32(sms), Int32(on), Int32(iters),
                   Int32(a.reps_alu), Float32(0.125), stream)
                torch.cuda.synchronize()
                if launch == 0:
                    continue  # warm-up (module load, clocks)
                for cta in stamps.cpu().tolist():  # per SM: 4 GEMM warps, then 4 ALU warps
                    g0, g1 = min(w[0] for w in cta[:4]), max(w[1] for w in cta[:4])
                    gemm += [w[1] - w[0] for w in cta[:4]]
                    lag.append(g0 - min(w[0] for w in cta[4:]))
                    alu += [w[1] - w[0] for w in cta[4:]]
                    inside += [w[1] <= g1 for w in cta[4:]]
            res[on] = statistics.median(alu)
            g = statistics.median(gemm)
            name = {0: "off", 1: "on ", 2: "idle", 3: "ffma"}[on]
            line = (f"{'RS' if rs else 'SS'} gemm {name}: ALU warp {res[on]:9.0f} cycles "
                    f"({res[on] / a.reps_alu:7.1f} a softmax round, min {min(alu)}, max {max(alu)}); "
                    f"GEMM warps {g:9.0f} cycles")
            if on == 1:
                line += (f" ({g / iters:.0f} a 64x128x128 chain), starting {statistics.median(lag):.0f} after "
                         f"the ALU; ALU ends before the GEMM {100.0 * sum(inside) / len(inside):.1f} %")
            print(line, flush=True)
        print(f"{'RS' if rs else 'SS'} ratios to off: " + ", ".join(f"mode {m} {res[m] / res[0]:.3f}" for m in res if m)
              + f" (sink checksum {float(sink.double().sum()):.4g})", flush=True)


if __name__ == "__main__":
    main()
