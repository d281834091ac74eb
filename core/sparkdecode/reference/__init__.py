"""The reference path: Muse Spark's stock math in plain torch, its paged KV cache,
and a reference provider for every block (the oracle and the fallback)."""
