"""Errors raised by the capture tool. Each message is one line that names the problem and what to do."""


class CaptureError(Exception):
    """A capture cannot proceed (bad input, inconsistent model run, write failure)."""


class UnsupportedModelError(CaptureError):
    """The model's attention cannot be hooked or cannot be represented by kvsim trace format v1."""


class MissingDependencyError(CaptureError):
    """An optional Python package (transformers, PIL, cv2) is needed but not installed."""


class CaptureOutOfMemoryError(CaptureError):
    """The accelerator ran out of memory while recording."""
