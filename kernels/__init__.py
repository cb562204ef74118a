"""Triton kernels: MoE row gather/combine, fused SwiGLU, the ECHO planner loop, fused cross-entropy
(NVLink dispatch next)."""
