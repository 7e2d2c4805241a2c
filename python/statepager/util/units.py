"""Byte units, one definition for the package."""
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GB = 10**9
