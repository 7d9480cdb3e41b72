"""Tests of memory sizing and model configs."""
