"""``from_packed``: the one-argument host entry of a kernel whose ``__call__`` takes only
pointers and scalars, then the stream (the sm120 kernels). Compiled with a schema from
``launch_args.schema_like`` of the ``__call__`` arguments, so a cached call packs its values into
one struct instead of converting each argument in Python (launch_args.py says why)."""
from __future__ import annotations

import cutlass.cute as cute


class PackedEntry:
    @cute.jit
    def from_packed(self, args, stream):
        self.__call__(*args.values, stream)
