#!/usr/bin/env python3
"""Reads a kvsim trace (docs/trace-format.md) with h5py: layer 3's keys for KV head 0 and the token modalities.

Usage: read_trace_example.py TRACE.h5
"""
import sys

import h5py
import numpy as np

with h5py.File(sys.argv[1], "r") as f:
    assert f.attrs["format"] == "kvsim-trace" and f.attrs["format_version"] == 1
    keys = f["layers/layer_003/keys"][0].astype(np.float32)  # [T, head_dim]; reads only head 0's chunks
    modality = f["tokens/modality"][:]  # uint8 codes
    names = f["tokens/modality"].attrs["names"].split(",")  # "text,image,video,other"

print("keys", keys.dtype, keys.shape)
print("first key %.6f" % keys[0, 0])
print("modality counts", {names[c]: int(n) for c, n in zip(*np.unique(modality, return_counts=True))})
