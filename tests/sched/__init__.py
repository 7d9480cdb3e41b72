"""Tests of the reference scheduler."""
