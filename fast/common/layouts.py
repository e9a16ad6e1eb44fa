"""Layout helpers for mma.sync (SM80-class) fragments and shared-memory tiles."""
import cutlass
import cutlass.cute as cute


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View an m16n8 accumulator fragment ((2, 2), MMA_M, MMA_N) as (rows, cols) of this thread."""
    lay = cute.make_layout(acc.layout.shape)  # column-major over the fragment's own modes
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def acc_as_A(frag: cute.Tensor) -> cute.Tensor:
    """Reuse an m16n8k16 C fragment (4, MMA_M, MMA_N) as an A operand ((4, 2), MMA_M, MMA_N / 2).

    Two adjacent n8 accumulator tiles hold exactly the values of one k16 A tile of the same
    thread, so P goes from the S accumulator into the PV product without shared memory.
    """
    d = cute.logical_divide(frag.layout, (None, None, 2))
    lay = cute.make_layout(
        ((d.shape[0], d.shape[2][0]), d.shape[1], d.shape[2][1]),
        stride=((d.stride[0], d.stride[2][0]), d.stride[1], d.stride[2][1]),
    )
    return cute.make_tensor(frag.iterator, lay)


def smem_layout_rowmajor(dtype, rows: int, cols: int):
    """Swizzled (rows, cols) row-major smem tile: conflict-free for 16-byte cp.async and ldmatrix."""
    k_atom = 64 if cols % 64 == 0 else 32
    bits = 3 if k_atom == 64 else 2
    atom = cute.make_composed_layout(
        cute.make_swizzle(bits, 3, 3), 0, cute.make_layout((8, k_atom), stride=(k_atom, 1)))
    return cute.tile_to_shape(atom, (rows, cols), (0, 1)), k_atom
