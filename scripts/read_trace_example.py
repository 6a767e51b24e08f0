#!/usr/bin/env python3
"""Reads a kvsim trace (docs/trace-format.md) with h5py: the last layer's keys for KV head 0 and the token
modalities. Works on any trace (any number of layers; strings stored fixed-length, as kvsim writes them, or
variable-length, as older traces have them).

Usage: read_trace_example.py TRACE.h5   (with the project's Python: .venv/bin/python)
"""
import sys

import h5py
import numpy as np


def text(value):
    """A string attribute as str: fixed-length strings come back from h5py as bytes."""
    return value.decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else str(value)


with h5py.File(sys.argv[1], "r") as f:
    assert text(f.attrs["format"]) == "kvsim-trace" and f.attrs["format_version"] == 1
    last = int(f.attrs["num_layers"]) - 1
    keys = f["layers/layer_%03d/keys" % last][0].astype(np.float32)  # [T, head_dim]; reads only head 0's chunks
    modality = f["tokens/modality"][:]  # uint8 codes
    names = text(f["tokens/modality"].attrs["names"]).split(",")  # "text,image,video,other"

print("layer", last, "keys", keys.dtype, keys.shape)
print("first key %.6f" % keys[0, 0])
print("modality counts", {names[c]: int(n) for c, n in zip(*np.unique(modality, return_counts=True))})
