"""Tests of the block pool, free queue, hashing and the manager facade."""
