"""Quantization overrides loop: suggest from a comparison, write, verify on QNN HTP (``docs/tune.md``)."""
