"""Capture helper for the GPU tests: warm ``step`` up on a side stream, as torch.cuda.graph's
documentation asks (lazy initialisation and Triton compiles happen there), then capture one call."""

import torch


def warm_up_and_capture(step, warmup: int = 1):
    """(graph, what the captured ``step()`` returned): replaying the graph reruns that call in place."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
