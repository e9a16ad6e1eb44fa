"""The SASS of fast-sm90 kernels, read on a machine without a GPU: the PTX of a config assembled
for sm_90a by the ptxas that Triton ships and disassembled by its cuobjdump. Used by
tests/test_sm90_sass.py (code-generation guards) and ci/sm90_loop_budget.py (what one key block
costs each pipe of an SM sub-partition).
"""
from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from typing import Dict, List, Optional, Tuple

# H100 SXM per-SM rates (NVIDIA H100 whitepaper; CUDA C programming guide, arithmetic instruction
# throughput for compute capability 9.0): dense bf16 tensor FLOP per clock (989.4 TFLOP/s =
# 132 SMs x 4096 x 1830 MHz), MUFU exponentials per clock, and one instruction issued per clock
# by each of the 4 sub-partitions (SMSPs).
TENSOR_FLOP_PER_CLK_SM = 4096
MUFU_PER_CLK_SM = 16
SMSPS = 4
H100_DENSE_BF16_TFLOPS = 989.4


def tool_dir() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def assemble(ptx: str, workdir, controls: Optional[list] = None) -> Tuple[str, List[str]]:
    """(ptxas -v log, SASS instruction lines) of ``ptx`` built for sm_90a in ``workdir``. A Triton
    without ptxas / cuobjdump raises (a check must not silently stop checking). ``controls``, a
    list, receives each instruction's scheduling fields (_control), line for line."""
    bin_dir = tool_dir()
    for tool in ("ptxas", "cuobjdump"):
        if not os.path.exists(os.path.join(bin_dir, tool)):
            raise FileNotFoundError(f"Triton ships no {tool} at {bin_dir}")
    src, obj = os.path.join(workdir, "k.ptx"), os.path.join(workdir, "k.cubin")
    with open(src, "w") as f:
        f.write(ptx)
    r = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", src, "-o", obj],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", obj], capture_output=True,
                          text=True, timeout=120).stdout
    lines = sass.splitlines()
    instr = [i for i, ln in enumerate(lines) if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    if controls is not None:
        controls[:] = [_control(lines[i + 1]) if i + 1 < len(lines) else None for i in instr]
    return r.stderr, [lines[i] for i in instr]


def _control(second_word_line: str):
    """The scheduling fields ptxas encodes in the top 23 bits of an instruction's second 64-bit
    word (Volta and later): the stall count (cycles before the warp's next instruction may
    issue), the yield hint, the variable-latency write / read scoreboards it sets (7: none), the
    mask of scoreboards it waits on, and the operand-reuse flags."""
    m = re.search(r"/\* (0x[0-9a-f]{16}) \*/", second_word_line)
    if not m:
        return None
    ctrl = int(m.group(1), 16) >> 41
    return {"stall": ctrl & 0xF, "yield": (ctrl >> 4) & 1, "write_sb": (ctrl >> 5) & 7,
            "read_sb": (ctrl >> 8) & 7, "wait_mask": (ctrl >> 11) & 0x3F, "reuse": (ctrl >> 17) & 0xF}


def exp2_spacing(body: List[str], controls: List[dict]) -> Tuple[int, List[int]]:
    """(stall-count clocks of ``body``, clocks between its consecutive MUFU.EX2): what ptxas's
    stall counts alone make one warp spend issuing a straight run of code, and how far apart they
    put its exponentials (``controls``: assemble's fields for the same lines)."""
    clock, last, gaps = 0, None, []
    for line, c in zip(body, controls):
        if opcode(line).startswith("MUFU.EX2"):
            if last is not None:
                gaps.append(clock - last)
            last = clock
        clock += c["stall"]
    return clock, gaps


def opcode(line: str) -> str:
    """The instruction's opcode with its modifiers (``HGMMA.64x128x16.F32.BF16``), predicate
    dropped."""
    fields = line.split(";")[0].split("*/", 1)[-1].split()
    if fields and fields[0].startswith("@"):
        fields = fields[1:]
    return fields[0] if fields else ""


def key_block_loops(sass: List[str]) -> List[Tuple[int, int]]:
    """(first, last) line indices of the innermost loops whose body issues HGMMA: a backward
    branch's target up to the branch, with no other such loop inside. Branches past the last
    EXIT are left out: ptxas puts the mbarrier wait retries there, out of line, each jumping
    back into the code it came from (not a loop of that code)."""
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in sass]
    index = {a: i for i, a in enumerate(addr)}
    last_exit = max(i for i, ln in enumerate(sass) if re.search(r"\bEXIT\b", ln))
    spans = []
    for i, ln in enumerate(sass[:last_exit]):
        m = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in index:
            lo = index[int(m.group(1), 16)]
            if any("HGMMA" in x for x in sass[lo:i + 1]):
                spans.append((lo, i))
    return [(lo, hi) for lo, hi in spans
            if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in spans)]


def steady_loop(sass: List[str]) -> Tuple[int, int]:
    """The key-block loop without mask selects (the unmasked blocks, most of a long tile's)."""
    loops = key_block_loops(sass)
    return min(loops, key=lambda s: (sum("FSEL" in ln for ln in sass[s[0]:s[1] + 1]), s[0] - s[1]))


def loop_budget(body: List[str], warpgroups: int) -> Dict[str, float]:
    """What one pass of a key-block loop (one key block) costs an SM sub-partition, in clocks.

    Every consumer warpgroup has one warp on each SMSP and runs the same loop, so an SMSP issues
    ``warpgroups`` x the loop's instructions; its MUFU quarter (4 lanes) takes 8 clocks per warp
    instruction; the tensor work is the warpgroups' HGMMA FLOPs at the SM's rate (the 4 tensor
    cores serve one warpgroup's HGMMA together)."""
    ops = Counter(opcode(ln) for ln in body)
    base = Counter(op.split(".")[0] for op in ops.elements())
    flop = 0
    for op, n in ops.items():
        m = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", op)
        if m:
            flop += n * 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3))
    lanes_per_smsp = MUFU_PER_CLK_SM // SMSPS
    tensor = warpgroups * flop / TENSOR_FLOP_PER_CLK_SM
    mufu = warpgroups * base["MUFU"] * 32 / lanes_per_smsp
    issue = warpgroups * sum(base.values())
    return {"instructions": sum(base.values()), "mufu": base["MUFU"], "hgmma": base["HGMMA"],
            "ffma": base["FFMA"], "fadd": base["FADD"], "fmul": base["FMUL"], "fmnmx": base["FMNMX"],
            "tensor_clk": tensor, "mufu_clk": mufu, "issue_clk": issue}


def _defs_uses(line: str) -> Tuple[List[int], List[int]]:
    """(registers written, registers read) by one SASS instruction (R0-R254; RZ and uniform,
    predicate and barrier registers left out). The first operand is the destination except for
    stores, barriers, branches, wgmma syncs and mbarrier operations, which write no register."""
    body = line.split(";")[0].split("*/", 1)[-1].strip()
    if body.startswith("@"):
        body = body.split(None, 1)[1] if " " in body else ""
    parts = body.split(None, 1)
    if not parts:
        return [], []
    op, operands = parts[0], (parts[1] if len(parts) > 1 else "")
    fields = [f.strip() for f in operands.split(",")]
    regs = lambda text: [int(r) for r in re.findall(r"\bR(\d+)\b", text)]
    if (op.startswith(("SYNCS", "BAR", "BRA", "WARPGROUP", "ST", "RED", "ATOM")) or not fields
            or not re.match(r"R\d+", fields[0])):
        return [], [r for f in fields for r in regs(f)]
    dest = regs(fields[0])
    wide = re.search(r"\.(64|128)\b", op)
    if wide and op.startswith("LD"):  # vector loads write consecutive registers
        dest = list(range(dest[0], dest[0] + int(wide.group(1)) // 32))
    return dest, [r for f in fields[1:] for r in regs(f)]


def registers_live_through(sass: List[str], lo: int, hi: int) -> List[int]:
    """Registers that the loop sass[lo:hi + 1] neither reads nor writes but the code after it
    reads before writing them: values held across every pass of the loop for later (a linear
    walk of the code after the loop, branches ignored; an estimate, not a liveness analysis)."""
    in_loop = set()
    for line in sass[lo:hi + 1]:
        d, u = _defs_uses(line)
        in_loop |= set(d) | set(u)
    written, live = set(), set()
    for line in sass[hi + 1:]:
        d, u = _defs_uses(line)
        live |= {r for r in u if r not in written and r not in in_loop}
        written |= set(d)
    return sorted(live)
