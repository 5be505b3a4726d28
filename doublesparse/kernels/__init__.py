"""Decode kernels (Triton) and their float32 PyTorch references."""
