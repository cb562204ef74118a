"""Parallelism: device mesh, FSDP2 + EP parallelize, grad-norm clipping across meshes, process groups,
the CUDA-graph step wrapper."""
