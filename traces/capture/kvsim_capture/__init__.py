"""kvsim_capture: records real model runs (prefill + decode) into kvsim traces (docs/capture.md).

Core (needs torch, numpy, h5py): Recorder / CaptureOptions / capture_attention (recorder.py),
build_token_metadata (metadata.py), TraceWriter (writer.py), encode_stream_blocks (blocks.py).
Hugging Face transformers adapter (imported lazily): kvsim_capture.hf.
"""
from .errors import (CaptureError, CaptureOutOfMemoryError, MissingDependencyError,  # noqa: F401
                     UnsupportedModelError)
from .metadata import TokenMetadata, build_token_metadata  # noqa: F401
from .recorder import VERSION, CaptureOptions, Recorder, active_recorder, capture_attention  # noqa: F401
from .writer import TraceWriter  # noqa: F401

__version__ = VERSION
