"""fast-sm90 A/B of the split tail's plan against section 25's (GPU only; docs section 52):
section 25 split the smallest tail that covers the partly filled last round and one more, dealt
in a snake, refused where its heads' K/V do not fit an L2 section or the snake's model gains
under 1 %. The setting "_TAIL_MODE=old" plans that way (as a table: the kernel reads any deal);
"" is the current plan (tile_order.split_tail_plan).

    python ci/split_tail_ab.py "_TAIL_MODE=old" "" 8,2048,8,256,1 8,2048,32,64,1

Cells as ci/sm90_env_ab.py takes them; it prints TFLOP/s both ways and time B / time A."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dualattn.fast.sm90 as sm90  # noqa: E402
from dualattn.fast.common import tile_order as T  # noqa: E402
import sm90_env_ab  # noqa: E402

sm90._TAIL_MODE = ""
_current = sm90.FastSm90Forward.split_tail_schedule.__func__


def _section25_schedule(cls, spec, num_sms):
    if sm90._TAIL_MODE != "old":
        return _current(cls, spec, num_sms)
    g = cls.pack_gqa(spec)
    nm = -(-(g * spec.seqlen_q) // cls.config(spec)[0])
    hb = spec.batch * (spec.num_heads_q // g)
    units = T.paired_units(nm, hb)
    key_blocks = cls.paired_key_blocks(spec)
    ctas = min(units, num_sms)
    _, hpg, upg = T._pair_groups(nm)
    tail = T.split_tail_groups(units, upg, -(-hb // hpg), ctas, min)
    row_bytes = (spec.head_dim + spec.head_dim_v) * spec.dtype.itemsize
    share = spec.num_heads_q // max(spec.num_heads_kv, 1) // g
    fits = T._split_tail(nm, hb, ctas, tail, min)[3] <= T.heads_per_section(spec.seqlen_k, row_bytes, max) * share
    if tail == 0 or not fits:
        return 0, 0, []

    def cost(m):
        return key_blocks(m) + sm90.SPLIT_TAIL_TILE_OVERHEAD

    # section 25's model: every CTA's pairs at the mean pair's cost
    mean_pair = sum(cost(m) for m in range(nm)) * hpg / upg
    prefix = [[i * mean_pair for i in range(-(-units // ctas) + 1)] for _ in range(ctas)]
    rounds, table, busiest = T.split_tail_table(nm, hb, ctas, tail, cost, "snake", prefix)
    if busiest > 0.99 * -(-units // ctas) * mean_pair:
        return 0, 0, []
    return tail, rounds, table


sm90.FastSm90Forward.split_tail_schedule = classmethod(_section25_schedule)

if __name__ == "__main__":
    sm90_env_ab.main(sys.argv[1], sys.argv[2], sys.argv[3:])
