"""Typed errors of the quantizers."""

from __future__ import annotations

from ktconvert.errors import InputError


class QuantError(InputError):
    """A tensor cannot be (de)quantized as asked: a row length the type cannot hold, a non-finite value,
    bytes that do not form whole blocks, or a type with no implementation.

    Raised before any work is done, so nothing half-quantized is ever returned or written.
    """
