"""Shared fixtures for the stage tests: one generated weights file, the loaded model, and
images encoded by Pillow."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from stages.model import TinyVLM, generate
from stages.payloads import VLMRequest
from stages.preprocess import prepare
from stages.weights import default_path, ensure_weights, load_model


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread, as the stages do, so numerics match theirs bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private weights cache directory holding the generated TINY_VLM weights."""
    root = tmp_path_factory.mktemp("stagewire-cache")
    ensure_weights(root / default_path().name)
    return root


@pytest.fixture(scope="session")
def model(cache_dir: Path) -> TinyVLM:
    """The whole model, loaded from the cached file as the reference uses it."""
    return load_model(cache_dir / default_path().name)


def reference(model: TinyVLM, request: VLMRequest, max_new_tokens: int) -> list[int]:
    """The single-process reference: preprocess and generate, on one thread."""
    with single_thread():
        pixels, ids = prepare(request)
        return generate(model, pixels, ids, max_new_tokens)


def encoded(image: Image.Image | np.ndarray, fmt: str, **options: Any) -> bytes:
    """``image`` (a Pillow image, or a uint8 array of any mode Pillow infers) as ``fmt`` bytes."""
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()
