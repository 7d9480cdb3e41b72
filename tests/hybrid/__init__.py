"""Tests of the per-attention-type managers and the hybrid coordinator."""
