"""Tests of KV events on the wire: codec, fuzzing, the ZeroMQ transport."""
