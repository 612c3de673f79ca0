"""Preprocessing and tokenising: what the encoder and decoder receive, and what is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline import Context
from stages.model import BOS, TINY_VLM
from stages.payloads import VLMRequest
from stages.png import encode_png
from stages.preprocess import InvalidRequest, Preprocess, prepare, to_rgb
from stages.tokenizer import TextStream, encode

SEED = 11


def _rgb(height: int, width: int) -> np.ndarray:
    """A seeded random uint8 RGB image."""
    print(f"seed {SEED}")
    return np.random.default_rng(SEED).integers(0, 256, (height, width, 3), dtype=np.uint8)


def test_tokens_are_bos_then_utf8_bytes() -> None:
    """A prompt becomes BOS followed by its UTF-8 bytes."""
    assert encode("hé") == [BOS, ord("h"), 0xC3, 0xA9]


def test_text_stream_holds_back_split_characters() -> None:
    """A multi-byte character split across chunks appears once it is complete; specials vanish."""
    stream = TextStream()
    rainbow = list("🌈".encode())
    assert stream.push([ord("a"), *rainbow[:2]]) == "a"
    assert stream.push([*rainbow[2:], 257, ord("b")]) == "🌈b"
    assert stream.push([0xF0]) == ""
    assert stream.flush() == "\ufffd"


def test_png_bytes_and_raw_pixels_give_identical_inputs() -> None:
    """The same image sent as PNG or as a pixel tensor preprocesses to the same pixels."""
    image = _rgb(45, 70)
    png, ids_png = prepare(VLMRequest(prompt="hi", image=encode_png(image)))
    raw, ids_raw = prepare(VLMRequest(prompt="hi", pixels=torch.from_numpy(image)))
    assert torch.equal(png, raw)
    assert ids_png == ids_raw == [BOS, ord("h"), ord("i")]


def test_pixels_are_resized_and_normalised_to_the_encoder_input() -> None:
    """Any image becomes float32 (3, 32, 32) in [-1, 1]; a 32x32 image is only rescaled."""
    pixels, _ = prepare(VLMRequest(prompt="x", pixels=torch.from_numpy(_rgb(300, 17))))
    assert pixels.dtype == torch.float32
    assert tuple(pixels.shape) == (3, TINY_VLM.image_size, TINY_VLM.image_size)
    assert pixels.is_contiguous()
    assert float(pixels.min()) >= -1.0 and float(pixels.max()) <= 1.0
    exact = _rgb(32, 32)
    pixels, _ = prepare(VLMRequest(prompt="x", pixels=torch.from_numpy(exact)))
    expected = torch.from_numpy(exact).permute(2, 0, 1).float() / 255.0 * 2 - 1
    torch.testing.assert_close(pixels, expected)


def test_a_white_image_is_all_ones() -> None:
    """Full-intensity pixels map to 1.0 after resizing: antialiasing keeps a flat image flat."""
    white = torch.full((50, 60, 3), 255, dtype=torch.uint8)
    pixels, _ = prepare(VLMRequest(prompt="x", pixels=white))
    torch.testing.assert_close(pixels, torch.ones_like(pixels))


def test_the_longest_prompt_that_fits_is_accepted() -> None:
    """A prompt of exactly max_prompt_bytes bytes is accepted; one more byte is refused."""
    n = TINY_VLM.max_prompt_bytes
    pixels = torch.zeros(8, 8, 3, dtype=torch.uint8)
    _, ids = prepare(VLMRequest(prompt="a" * n, pixels=pixels))
    assert len(ids) == n + 1
    assert TINY_VLM.n_patches + len(ids) == TINY_VLM.max_context - 1
    with pytest.raises(InvalidRequest, match=f"prompt is {n + 1} bytes long"):
        prepare(VLMRequest(prompt="a" * (n + 1), pixels=pixels))


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (VLMRequest(prompt="", pixels=torch.zeros(4, 4, 3, dtype=torch.uint8)), "prompt is empty"),
        (
            VLMRequest(prompt=" \n", pixels=torch.zeros(4, 4, 3, dtype=torch.uint8)),
            r"prompt is blank \(only whitespace\)",
        ),
        (
            VLMRequest(prompt="é" * 60, pixels=torch.zeros(4, 4, 3, dtype=torch.uint8)),
            "prompt is 120 bytes long but the model's context of 128 positions leaves room for "
            "at most 110 prompt bytes after the 16 image tokens",
        ),
        (VLMRequest(prompt="x"), "request has no image"),
        (
            VLMRequest(
                prompt="x", image=b"\x89PNG", pixels=torch.zeros(4, 4, 3, dtype=torch.uint8)
            ),
            "both image bytes and pixels",
        ),
        (
            VLMRequest(prompt="x", pixels=torch.zeros(3, 32, 32, dtype=torch.uint8)),
            r"pixels must be a uint8 tensor of shape \(height, width, 3\); "
            r"got uint8 of shape \(3, 32, 32\)",
        ),
        (
            VLMRequest(prompt="x", pixels=torch.zeros(32, 32, 3)),
            r"got float32 of shape \(32, 32, 3\)",
        ),
        (
            VLMRequest(prompt="x", pixels=torch.zeros(32, 32, dtype=torch.uint8)),
            r"got uint8 of shape \(32, 32\)",
        ),
        (
            VLMRequest(prompt="x", pixels=torch.zeros(0, 5, 3, dtype=torch.uint8)),
            "pixels are 5x0; each side must be 1 to 4096",
        ),
        (VLMRequest(prompt="x", image=b"\xff\xd8\xff\xe0JFIF"), "JPEG images are not supported"),
        (VLMRequest(prompt="x", image=b"hello world"), "image is not a PNG"),
        (
            VLMRequest(prompt="x", image=encode_png(np.zeros((4, 4, 3), np.uint8))[:-30]),
            "corrupt or unsupported PNG image: .*truncated",
        ),
    ],
    ids=[
        "empty-prompt",
        "blank-prompt",
        "long-prompt",
        "no-image",
        "two-images",
        "chw-pixels",
        "float-pixels",
        "grey-pixels",
        "zero-height",
        "jpeg",
        "not-an-image",
        "truncated-png",
    ],
)
def test_invalid_requests_say_what_is_wrong(request_: VLMRequest, message: str) -> None:
    """Each unusable request raises InvalidRequest whose message names the problem."""
    with pytest.raises(InvalidRequest, match=message):
        prepare(request_)


def test_to_rgb_decodes_png_to_hwc_uint8() -> None:
    """PNG bytes become a (height, width, 3) uint8 tensor of the same pixels."""
    image = _rgb(5, 9)
    rgb = to_rgb(VLMRequest(prompt="x", image=encode_png(image)))
    assert rgb.dtype == torch.uint8
    assert np.array_equal(rgb.numpy(), image)


async def test_the_stage_routes_pixels_to_encode_and_ids_to_prefill() -> None:
    """Preprocess.process returns pixels for 'encode' and token ids for 'prefill'."""
    stage = Preprocess(params=None, name="preprocess", replica=0, device="cpu")
    request = VLMRequest(prompt="ok", pixels=torch.from_numpy(_rgb(20, 20)))
    out = await stage.process(request, Context("r1", "preprocess", 0))
    pixels, ids = prepare(request)
    assert out.encode is not None and out.prefill is not None
    assert torch.equal(out.encode.values, pixels)
    assert out.prefill.ids == ids
