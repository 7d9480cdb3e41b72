"""Helpers shared by the test folders (builders, workloads, servers, pytest hooks); no tests."""
