"""Code-generation helpers shared by the CuTe DSL kernels."""
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def per_use_i32(x: Int32, *, loc=None, ip=None) -> Int32:
    """``x`` itself, through a volatile ``mov`` the compiler may not move or merge: what is
    computed from it is computed where it is used. Values derived only from loop-invariant
    inputs (a thread's shared-memory addresses for the epilogue, from its thread index) are
    otherwise hoisted out of the kernel's tile loop and held in registers across every key
    block, where the main loop needs them (fast/sm90: 16 such addresses at hd128 made ptxas
    put the P V wait before the exponentials)."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _read_special(reg: str, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(T.i32(), [], f"mov.u32 $0, %{reg};", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))


@dsl_user_op
def trace_registers(*, loc=None, ip=None):
    """(%clock, %smid, %globaltimer_lo) of the calling thread, each read where it is called: the
    stamps of a kernel's phase trace (diagnostics; fast/sm90 trace_phases)."""
    return (_read_special("clock", loc, ip), _read_special("smid", loc, ip),
            _read_special("globaltimer_lo", loc, ip))
