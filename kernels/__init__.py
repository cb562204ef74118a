"""Triton kernels: MoE row gather/combine, fused SwiGLU, the ECHO planner loop (NVLink dispatch next)."""
