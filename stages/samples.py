"""Sample inputs for the tiny-VLM pipeline: shipped images and prompts, and requests built
from them.

``stages/assets/`` holds six small PNG images of deterministic patterns (rendered here and
written with Pillow), eight prompts, and ``requests.jsonl``: twelve requests as JSON
lines (the image base64-encoded) for ``stagewire run --input-file``. Regenerate them all
with ``python -m stages.samples``; a test checks that the shipped files match.
"""

from __future__ import annotations

import io
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np
from numpy.typing import NDArray
from PIL import Image

from stages.payloads import VLMRequest

__all__ = (
    "ASSETS",
    "PROMPTS",
    "encode_png",
    "load_images",
    "load_prompts",
    "render_images",
    "sample_requests",
    "write_assets",
)

ASSETS = Path(__file__).resolve().parent / "assets"
#: The shipped prompts; one is not ASCII, so multi-byte UTF-8 is exercised.
PROMPTS = (
    "What is in this picture?",
    "Describe the colours.",
    "Count the shapes.",
    "Is it day or night?",
    "Write a short caption.",
    "Which pattern repeats here?",
    "Where is the brightest region?",
    "¿Qué ves en la imagen? 🌈",
)
#: How many requests requests.jsonl holds.
JSONL_REQUESTS = 12


def _grid(height: int, width: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    return y, x


def _rgb(
    r: NDArray[np.float64], g: NDArray[np.float64], b: NDArray[np.float64]
) -> NDArray[np.uint8]:
    return np.clip(np.rint(np.stack((r, g, b), axis=-1)), 0, 255).astype(np.uint8)


def render_images() -> dict[str, NDArray[np.uint8]]:
    """The sample images, computed from closed formulas (no randomness), by name.

    Their sizes differ, and none but one is 32x32, so preprocessing must resize.
    """
    images: dict[str, NDArray[np.uint8]] = {}
    y, x = _grid(32, 32)
    images["gradient"] = _rgb(x * 8, y * 8, np.full_like(x, 128))
    y, x = _grid(40, 40)
    check = ((y // 5 + x // 5) % 2) * 255
    images["checker"] = _rgb(check, check * 0.6, 255 - check)
    y, x = _grid(48, 48)
    r = np.hypot(y - 23.5, x - 23.5)
    images["rings"] = _rgb(127.5 + 127.5 * np.sin(r), 80 + r * 3, 127.5 - 127.5 * np.sin(r))
    y, x = _grid(24, 36)
    stripe = ((x + y) // 4 % 2) * 200
    images["stripes"] = _rgb(stripe, 40 + y * 5, 220 - stripe)
    y, x = _grid(48, 64)
    disc = np.hypot(y - 20, x - 40) < 14
    images["disc"] = _rgb(np.where(disc, 230, 20), np.where(disc, 40, 60), np.where(disc, 30, 200))
    y, x = _grid(32, 32)
    wave = np.sin(x / 3) + np.sin(y / 5) + np.sin((x + y) / 7)
    images["plasma"] = _rgb(128 + 40 * wave, 128 + 40 * np.cos(wave * math.pi), 128 - 40 * wave)
    return images


def encode_png(pixels: NDArray[np.uint8]) -> bytes:
    """``uint8`` RGB ``(height, width, 3)`` as PNG bytes, written by Pillow.

    The compression level is fixed so the bytes do not follow Pillow's default; they may
    still differ between zlib builds, so the shipped files are checked by their pixels.
    """
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=9)
    return out.getvalue()


def load_images() -> dict[str, bytes]:
    """The shipped PNG images' bytes, by name, in name order."""
    return {p.stem: p.read_bytes() for p in sorted((ASSETS / "images").glob("*.png"))}


def load_prompts() -> list[str]:
    """The shipped prompts, one per line of ``prompts.txt``."""
    return (ASSETS / "prompts.txt").read_text(encoding="utf-8").splitlines()


def _pairs(images: Sequence[bytes], prompts: Sequence[str], n: int) -> list[VLMRequest]:
    return [
        VLMRequest(prompt=prompts[i % len(prompts)], image=images[i % len(images)])
        for i in range(n)
    ]


def sample_requests(n: int = JSONL_REQUESTS) -> list[VLMRequest]:
    """``n`` requests pairing the shipped images and prompts in turn (PNG bytes)."""
    return _pairs(list(load_images().values()), load_prompts(), n)


def write_assets(root: Path = ASSETS) -> list[Path]:
    """Render and write every sample file under ``root``; returns the paths written."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, pixels in render_images().items():
        path = root / "images" / f"{name}.png"
        path.write_bytes(encode_png(pixels))
        written.append(path)
    prompts = root / "prompts.txt"
    prompts.write_text("".join(f"{p}\n" for p in PROMPTS), encoding="utf-8")
    written.append(prompts)
    # Built from the files just written, so the JSON lines always match them.
    images = [p.read_bytes() for p in sorted((root / "images").glob("*.png"))]
    requests = _pairs(images, PROMPTS, JSONL_REQUESTS)
    jsonl = root / "requests.jsonl"
    jsonl.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in requests))
    written.append(jsonl)
    return written


def main() -> int:
    """Regenerate the shipped sample files (``python -m stages.samples``)."""
    for path in write_assets():
        sys.stdout.write(f"{path} ({path.stat().st_size} bytes)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
