"""Triton kernels (permutation, histogram, NVLink dispatch/combine) land here with the sync-free issue."""
