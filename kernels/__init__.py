"""Triton kernels, imported as ``minillm.kernels`` (one file per kernel, added by chapter 05).

Call :func:`minillm.device.setup_triton` before importing a kernel module when there is no GPU.
"""
