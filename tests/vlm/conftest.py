"""Shared fixtures: the shipped reference models and their legacy exports (built once per session)."""

from __future__ import annotations

import pytest

from ivq_debug.vlm.build import DEFAULT_BUCKET

MODELS = ("internvl-tiny", "qwen2vl-tiny", "qwen3vl-tiny")
#: buckets exported for the scheduler tests (the default plus the smallest)
TEST_BUCKETS = (DEFAULT_BUCKET, 56)


@pytest.fixture(scope="session")
def loaded():
    """name -> LoadedVLM of the shipped checkpoints."""
    from ivq_debug.vlm.load import load_vlm

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_vlm(name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def exported(loaded, tmp_path_factory):
    """name -> ExportResult of a legacy export of both test buckets (verified; with the fault variants the
    model's family has)."""
    from ivq_debug.vlm.build import family_of_reference
    from ivq_debug.vlm.export import export_parts

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(f"export-{name}")
            variants = ("mrope_sectioned",) if family_of_reference(name).mrope_layout == "interleaved" else ()
            cache[name] = export_parts(
                loaded(name).model, folder, buckets=TEST_BUCKETS, model_id=name, verify_samples=4, variants=variants
            )
        return cache[name]

    return get
