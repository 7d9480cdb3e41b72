"""Tests of the cluster-wide prefix index and the router service."""
