"""The conversion package's error type."""

from __future__ import annotations


class ConversionError(ValueError):
    """A model or folder that cannot be converted; one line naming the setting or file."""
