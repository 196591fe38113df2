"""Tests of ivq_debug.vlm (reference VLMs, split export, scheduler)."""
