"""The conversion package's error type."""

from __future__ import annotations

from megalite.errors import UserError


class ConversionError(UserError, ValueError):
    """A model or folder that cannot be converted; one line naming the setting or file."""
