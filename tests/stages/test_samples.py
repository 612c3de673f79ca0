"""The shipped sample inputs: present, decodable, in sync with their generator and each other."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from stages.payloads import VLMRequest
from stages.png import decode_png
from stages.preprocess import prepare
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


def test_shipped_images_match_their_generator() -> None:
    """Each shipped PNG decodes to its rendered pattern (within one level of rounding)."""
    rendered = render_images()
    shipped = load_images()
    assert sorted(shipped) == sorted(rendered)
    for name, data in shipped.items():
        decoded = decode_png(data).astype(int)
        assert decoded.shape == rendered[name].shape, name
        assert np.abs(decoded - rendered[name].astype(int)).max() <= 1, name
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


def test_writing_the_assets_reproduces_the_jsonl_exactly(tmp_path: Path) -> None:
    """Regenerating into a fresh directory writes a requests.jsonl equal to the shipped one."""
    written = write_assets(tmp_path)
    assert {p.name for p in written} >= {"requests.jsonl", "prompts.txt"}
    fresh = [
        msgspec.json.decode(x, type=VLMRequest)
        for x in (tmp_path / "requests.jsonl").read_bytes().splitlines()
    ]
    assert [r.prompt for r in fresh] == [r.prompt for r in sample_requests()]
    for mine, shipped in zip(fresh, sample_requests(), strict=True):
        assert (
            np.abs(decode_png(mine.image).astype(int) - decode_png(shipped.image).astype(int)).max()
            <= 1
        )


def test_every_sample_request_preprocesses() -> None:
    """Every sample request is valid input: pixels and token ids come out."""
    for request in sample_requests(24):
        pixels, ids = prepare(request)
        assert tuple(pixels.shape) == (3, 32, 32)
        assert len(ids) == len(request.prompt.encode()) + 1
