"""The shipped sample inputs: present, decodable, in sync with their generator and each other."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from stages.payloads import VLMRequest
from stages.preprocess import prepare, to_rgb
from stages.samples import (
    ASSETS,
    JSONL_REQUESTS,
    PROMPTS,
    load_images,
    load_prompts,
    render_images,
    sample_requests,
    write_assets,
)


def _decoded(png: bytes) -> np.ndarray:
    """The pixels preprocess decodes from ``png``."""
    return to_rgb(VLMRequest(prompt="x", image=png)).numpy()


def test_shipped_images_match_their_generator() -> None:
    """Each shipped PNG decodes to exactly its rendered pattern: PNG is lossless."""
    rendered = render_images()
    shipped = load_images()
    assert sorted(shipped) == sorted(rendered)
    for name, data in shipped.items():
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), name
        assert np.array_equal(_decoded(data), rendered[name]), name
    sizes = {img.shape[:2] for img in rendered.values()}
    assert len(sizes) >= 4, "the samples should exercise resizing from several sizes"


def test_shipped_files_are_small() -> None:
    """Everything under stages/assets stays well under the 4 MB budget."""
    total = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert total < 100_000


def test_shipped_prompts_match_the_list() -> None:
    """prompts.txt holds PROMPTS, one per line."""
    assert load_prompts() == list(PROMPTS)


def test_requests_jsonl_matches_the_shipped_files() -> None:
    """requests.jsonl decodes to the same requests that sample_requests builds."""
    lines = (ASSETS / "requests.jsonl").read_bytes().splitlines()
    decoded = [msgspec.json.decode(line, type=VLMRequest) for line in lines]
    assert decoded == sample_requests()
    assert len(decoded) == JSONL_REQUESTS
    assert all(r.pixels is None and r.image for r in decoded)


def test_writing_the_assets_reproduces_the_shipped_files(tmp_path: Path) -> None:
    """Regenerating into a fresh directory writes the shipped prompts and the same pixels.

    The PNG bytes depend on the zlib that Pillow was built with, so the images and the
    JSON lines that embed them are compared by their decoded pixels, not byte for byte.
    """
    written = write_assets(tmp_path)
    assert {p.name for p in written} >= {"requests.jsonl", "prompts.txt"}
    fresh = [
        msgspec.json.decode(x, type=VLMRequest)
        for x in (tmp_path / "requests.jsonl").read_bytes().splitlines()
    ]
    assert [r.prompt for r in fresh] == [r.prompt for r in sample_requests()]
    assert (tmp_path / "prompts.txt").read_bytes() == (ASSETS / "prompts.txt").read_bytes()
    for mine, shipped in zip(fresh, sample_requests(), strict=True):
        assert np.array_equal(_decoded(mine.image), _decoded(shipped.image))


def test_every_sample_request_preprocesses() -> None:
    """Every sample request is valid input: pixels and token ids come out."""
    for request in sample_requests(24):
        pixels, ids = prepare(request)
        assert tuple(pixels.shape) == (3, 32, 32)
        assert len(ids) == len(request.prompt.encode()) + 1
