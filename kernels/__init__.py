"""Triton kernels: MoE row gather/combine, fused SwiGLU, the ECHO planner loop, fused cross-entropy,
one-pass AdamW, NVLink peer-row copies, FP8 row/column quantisation."""
