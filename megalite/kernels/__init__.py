"""Triton kernels, installed as ``megalite.kernels``.

Nothing here imports triton at import time: each kernel family's builder imports it when a kernel
first runs, so ``import megalite`` works on machines without triton or a GPU.
"""
