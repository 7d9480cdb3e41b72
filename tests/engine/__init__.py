"""Tests of the torch engine adapter and its attention kernels."""
