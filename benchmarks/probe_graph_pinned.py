"""Probe: does a CUDA graph that captured a host-staged copy (``torch._chunk_cat``, which FSDP2's
reduce-scatter uses, stages its metadata in pinned host memory) survive later eager work that
allocates pinned memory? Prints one verdict line per check; exit code 0 either way.

    python benchmarks/probe_graph_pinned.py
"""

import torch


def chunk_cat_ref(xs, num_chunks):
    """[sum over inputs of rows/num_chunks per chunk ...]: torch._chunk_cat along dim 0, by hand."""
    parts = [x.view(num_chunks, -1) for x in xs]
    return torch.cat(parts, dim=1)


def main():
    dev = torch.device("cuda")
    print("torch", torch.__version__, "| host allocator empty_cache:", hasattr(torch._C, "_host_emptyCache"))
    xs = [torch.randn(n, 8, device=dev) for n in (4, 12, 20)]
    torch._chunk_cat(xs, 0, 4)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch._chunk_cat(xs, 0, 4)
    g.replay()
    torch.cuda.synchronize()
    ok_first = torch.equal(out, chunk_cat_ref(xs, 4))
    # eager traffic: other _chunk_cat calls (other shapes, so other metadata) and pinned buffers
    junk = []
    for i in range(200):
        ys = [torch.randn(n, 3 + i % 7, device=dev) for n in (8, 4 * (1 + i % 5))]
        torch._chunk_cat(ys, 0, 4)
        junk.append(torch.full((64 + i,), 0x7F7F7F7F, dtype=torch.int32, pin_memory=True))
        if len(junk) > 20:
            junk.pop(0)
    torch.cuda.synchronize()
    for x in xs:
        x.normal_()
    err = None
    try:
        g.replay()
        torch.cuda.synchronize()
        ok_after = torch.equal(out, chunk_cat_ref(xs, 4))
    except Exception as e:  # a corrupted pointer table faults
        ok_after, err = False, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    print(f"graph replay right after capture correct: {ok_first}")
    print(f"graph replay after eager pinned traffic correct: {ok_after}" + (f" ({err})" if err else ""))
    print("VERDICT:", "no pinned-staging hazard" if ok_after else "captured pinned staging is reused by eager work")


if __name__ == "__main__":
    main()
