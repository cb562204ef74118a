"""Device-side helpers for kernels that walk every expert's rows in fixed-size units (row blocks, tiles) without a
host read: the experts' row ranges from their cumulative row ends, and which expert owns the i-th unit.

    expert_ranges(offs_ptr, E, E_POW2) -> (lanes, starts, ends)   [E_POW2] each; lanes past E: empty at the end
    find_expert(i, cum, counts, lanes) -> (e, first)              counts[e] units of expert e, cum their running
                                                                  sum; first: the units before expert e's
    pick(x, lanes, e)                                             x[e] of a per-expert vector
"""

from .moe_rows import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def expert_ranges(offs_ptr, E, E_POW2: tl.constexpr):
        lanes = tl.arange(0, E_POW2)
        real = lanes < E
        ends = tl.load(offs_ptr + lanes, mask=real, other=0).to(tl.int32)
        last = tl.max(ends, 0)
        starts = tl.load(offs_ptr + lanes - 1, mask=(lanes >= 1) & real, other=0).to(tl.int32)
        return lanes, tl.where(real, starts, last), tl.where(real, ends, last)

    @triton.jit
    def pick(x, lanes, e):
        return tl.sum(tl.where(lanes == e, x, 0), 0)

    @triton.jit
    def find_expert(i, cum, counts, lanes):
        e = tl.sum((cum <= i).to(tl.int32), 0)
        return e, pick(cum - counts, lanes, e)
