"""Test fixture distribution: one third-party kernel for Kiln's `kiln.kernels` entry point."""
