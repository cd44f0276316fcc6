"""Triton kernels, installed as ``megalite.kernels``.

Nothing here imports triton at import time: each kernel module imports it when first used, so
``import megalite`` works on machines without triton or a GPU.
"""
