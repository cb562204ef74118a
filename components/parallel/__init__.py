"""Parallelism: device mesh, FSDP2 + EP parallelize functions, CUDA-graph step wrapper (later issues); data-parallel helpers now."""
