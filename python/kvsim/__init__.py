"""kvsim: the KV-cache compression replay simulator from Python (plots: python -m kvsim.plot)."""
