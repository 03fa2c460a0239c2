"""The one error type for bad model input."""
from __future__ import annotations


class ModelError(Exception):
    """A model folder or file we cannot use: missing file, unsupported architecture or field,
    truncated safetensors, corrupt GGUF. Its message is one line, fit to print as
    ``error: <message>`` with no traceback."""
