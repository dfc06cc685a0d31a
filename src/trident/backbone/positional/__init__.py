"""Positional encodings, chosen by name from a registry (config group ``pos_encoding``)."""

from trident.backbone.positional import absolute, bias, rotary  # noqa: F401  (register the encodings)
from trident.backbone.positional.absolute import sinusoidal_table
from trident.backbone.positional.base import (
    PositionalEncoding,
    available_pos_encodings,
    bidirectional_pos_encodings,
    build_pos_encoding,
    pos_encoding_class,
    positions_from,
    register_pos_encoding,
)
from trident.backbone.positional.bias import alibi_slopes, relative_bucket
from trident.backbone.positional.rotary import apply_rotary

__all__ = [
    "PositionalEncoding",
    "alibi_slopes",
    "apply_rotary",
    "available_pos_encodings",
    "bidirectional_pos_encodings",
    "build_pos_encoding",
    "pos_encoding_class",
    "positions_from",
    "register_pos_encoding",
    "relative_bucket",
    "sinusoidal_table",
]
