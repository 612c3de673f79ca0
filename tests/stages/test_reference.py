"""The staged tiny-VLM pipeline against the single-process reference, over real processes.

Correctness first: for 30 different (image, prompt) inputs (PNG and JPEG bytes in several
modes, and raw pixels), the tokens the pipeline streams
equal exactly those :func:`stages.model.generate` produces in this process. Then the shape
of the client's stream, and requests that must fail alone with a clear StageError.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch
from PIL import Image

from pipeline import Pipeline, PipelineSpec, StageError
from stages.model import TINY_VLM, TinyVLM
from stages.payloads import DecodeChunk, VLMRequest
from stages.samples import encode_png, render_images, sample_requests
from tests.pipeline.conftest import settled, wait_for
from tests.stages.conftest import encoded, reference

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: The transports every edge is run over, each in its own pipeline: the outputs must not change.
TRANSPORTS = ["inline", "shm", "network", "cuda_ipc", "auto"]
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-vlm.yaml"
SEED = 2024
_DECODE_PARAMS = PipelineSpec.from_yaml(CONFIG).stages["decode"].params
MAX_NEW_TOKENS: int = _DECODE_PARAMS["max_new_tokens"]
CHUNK_TOKENS: int = _DECODE_PARAMS["chunk_tokens"]
PROMPTS = [
    "A",
    "What do you see?",
    "Describe the image in detail, please.",
    "Ünïcödé and emoji 🌈🌧",
    "count: 1 2 3 4 5 6 7 8 9 10",
    "z" * 100,
]


def _encoded_images() -> list[bytes]:
    """The rendered samples as JPEGs of assorted settings and as PNGs with a palette or alpha.

    JPEG is lossy, so these are checked against the reference on the same bytes, never
    against the PNG of the same picture.
    """
    images = render_images()
    y, x = np.mgrid[0:32, 0:32]
    rgba = np.dstack((images["gradient"], ((x * 8 + y * 4) % 256).astype(np.uint8)))
    palette = Image.fromarray(images["stripes"]).quantize(colors=8)
    return [
        encoded(images["rings"], "JPEG", quality=90),
        encoded(images["plasma"], "JPEG", quality=50, progressive=True),
        encoded(Image.fromarray(images["disc"]).convert("L"), "JPEG"),
        encoded(images["checker"], "JPEG", quality=75, subsampling=0),
        encoded(palette, "PNG", transparency=3),
        encoded(rgba, "PNG"),
    ]


def _inputs() -> list[VLMRequest]:
    """12 shipped samples (PNG bytes), 6 encoded in other ways (JPEG, palette and RGBA PNG),
    and 12 seeded random images of assorted sizes (raw pixels: every other one a numpy
    array, the rest tensors)."""
    print(f"seed {SEED}")
    rng = np.random.default_rng(SEED)
    arrays = [rng.integers(0, 256, (9 + 7 * i, 50 - 3 * i, 3), dtype=np.uint8) for i in range(12)]
    raw = [
        VLMRequest(
            prompt=PROMPTS[i % len(PROMPTS)],
            pixels=array if i % 2 else torch.from_numpy(array),  # type: ignore[arg-type]
        )
        for i, array in enumerate(arrays)
    ]
    encoded_images = [
        VLMRequest(prompt=PROMPTS[(i + 2) % len(PROMPTS)], image=data)
        for i, data in enumerate(_encoded_images())
    ]
    return sample_requests(12) + encoded_images + raw


INPUTS = _inputs()


def _spec(transport: str, cache: Path) -> PipelineSpec:
    """configs/tiny-vlm.yaml with every edge on ``transport`` and weights from ``cache``."""
    data: dict[str, Any] = PipelineSpec.from_yaml(CONFIG).to_dict()
    data["defaults"]["transport"] = {"kind": transport}
    for edge in data["edges"]:
        edge["transport"] = {"kind": transport}
    for stage in data["stages"].values():
        stage["env"] = {"STAGEWIRE_CACHE_DIR": str(cache)}
    return PipelineSpec.from_dict(data)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=TRANSPORTS)
async def vlm(request: pytest.FixtureRequest, cache_dir: Path):
    """The tiny-VLM pipeline over one transport, started once per transport."""
    async with Pipeline(_spec(request.param, cache_dir)) as pipe:
        yield pipe


@pytest.fixture(scope="module")
def expected(model: TinyVLM) -> list[list[int]]:
    """The reference's tokens for every input, computed in this process."""
    return [reference(model, r, MAX_NEW_TOKENS) for r in INPUTS]


async def _collect(pipe: Pipeline, request: VLMRequest) -> list[DecodeChunk]:
    """Every chunk of one request's stream."""
    return [chunk async for chunk in pipe.stream(request)]


async def test_the_inputs_exercise_both_stopping_rules(expected: list[list[int]]) -> None:
    """The reference outputs differ across inputs, and some stop at EOS, some at the limit."""
    assert len({tuple(t) for t in expected}) >= 20
    lengths = [len(t) for t in expected]
    assert MAX_NEW_TOKENS in lengths
    assert any(n < MAX_NEW_TOKENS for n in lengths)


async def test_staged_tokens_equal_the_reference(vlm: Pipeline, expected: list[list[int]]) -> None:
    """30 concurrent requests stream exactly the reference's tokens, each in its own order.

    They decode at once, so the decode stage batches their steps: the check covers batched
    steps of every size the traffic makes, and the test fails if none were batched.
    """
    streams = await asyncio.gather(*(_collect(vlm, r) for r in INPUTS))
    for i, (chunks, want) in enumerate(zip(streams, expected, strict=True)):
        streamed = [t for c in chunks for t in c.token_ids]
        assert streamed == want, f"input {i}"
        assert chunks[-1].done and chunks[-1].generated_ids == want, f"input {i}"
    shared = [chunks[-1].timings["mean_batch"] for chunks in streams]
    assert max(shared) > 1, shared
    stats = await vlm.statistics()
    decode = next(r for r in stats["replicas"] if r["stage"] == "decode")["counters"]
    assert decode["steps"] > 0 and decode["mean_batch"] > 1, decode


async def test_sequential_requests_also_equal_the_reference(
    vlm: Pipeline, expected: list[list[int]]
) -> None:
    """Requests sent one at a time (no interleaving) give the same tokens as the reference."""
    for request, want in list(zip(INPUTS, expected, strict=True))[::5]:
        final = await vlm.submit(request)
        assert final.generated_ids == want


async def test_the_stream_is_small_chunks_then_a_summary(
    vlm: Pipeline, expected: list[list[int]]
) -> None:
    """The first token comes alone, then chunks of at most chunk_tokens (fewer when a
    token would wait past chunk_ms), then one final summary."""
    index = next(i for i, t in enumerate(expected) if len(t) == MAX_NEW_TOKENS)
    chunks = await _collect(vlm, INPUTS[index])
    *progress, final = chunks
    sizes = [len(c.token_ids) for c in progress]
    assert sizes[0] == 1 and all(1 <= s <= CHUNK_TOKENS for s in sizes), sizes
    assert sum(sizes) == MAX_NEW_TOKENS
    assert not any(c.done for c in progress)
    assert final.done and final.token_ids == []
    assert final.text == "".join(c.text_delta for c in chunks)
    assert final.text == bytes(t for t in expected[index] if t < 256).decode("utf-8", "replace")
    assert final.stop_reason == "max_new_tokens"
    timings = {
        "kv_receive_ms",
        "first_token_ms",
        "decode_ms",
        "tokens_per_s",
        "mean_batch",
        "model_ms",
    }
    assert set(final.timings) == timings
    assert all(v >= 0 for v in final.timings.values())
    assert final.timings["tokens_per_s"] > 0
    assert final.timings["mean_batch"] == 1.0  # decoded alone
    assert 0 < final.timings["model_ms"] <= final.timings["decode_ms"]


async def test_an_early_eos_ends_the_stream_with_stop_reason_eos(
    vlm: Pipeline, expected: list[list[int]]
) -> None:
    """A request whose reference stops at EOS gets a summary saying so, with EOS not emitted."""
    index = next(i for i, t in enumerate(expected) if len(t) < MAX_NEW_TOKENS)
    final = await vlm.submit(INPUTS[index])
    assert isinstance(final, DecodeChunk)
    assert final.stop_reason == "eos"
    assert final.generated_ids == expected[index]


def _corrupt(png: bytes) -> bytes:
    """Flip a byte inside the IDAT chunk, breaking its CRC."""
    at = png.index(b"IDAT") + 8
    return png[:at] + bytes([png[at] ^ 0x55]) + png[at + 1 :]


def _claiming(jpeg: bytes, width: int, height: int) -> bytes:
    """``jpeg`` with its frame header patched to claim ``width`` x ``height``."""
    at = jpeg.index(b"\xff\xc0") + 5
    return jpeg[:at] + struct.pack(">HH", height, width) + jpeg[at + 4 :]


GOOD_PNG = encode_png(np.full((20, 24, 3), 90, np.uint8))
GOOD_JPEG = encoded(render_images()["rings"], "JPEG", quality=95)
BAD_REQUESTS = [
    pytest.param(
        VLMRequest(prompt="hi", image=_corrupt(GOOD_PNG)),
        "corrupt or truncated PNG image: broken PNG file (bad header checksum in b'IDAT')",
        id="corrupt-png",
    ),
    pytest.param(
        VLMRequest(prompt="hi", image=GOOD_PNG[:-30]),
        "corrupt or truncated PNG image: Truncated File Read",
        id="truncated-png",
    ),
    pytest.param(
        VLMRequest(prompt="hi", image=b"\xff\xd8\xff\xe0" + bytes(100)),
        "corrupt or truncated JPEG image: unreadable header",
        id="corrupt-jpeg",
    ),
    pytest.param(
        VLMRequest(prompt="hi", image=GOOD_JPEG[: len(GOOD_JPEG) // 2]),
        "corrupt or truncated JPEG image: image file is truncated",
        id="truncated-jpeg",
    ),
    pytest.param(
        VLMRequest(prompt="hi", image=encoded(np.zeros((8, 8, 3), np.uint8), "GIF")),
        "image is a GIF, not a PNG or JPEG; send PNG or JPEG bytes, or raw pixels",
        id="gif",
    ),
    pytest.param(
        VLMRequest(prompt="hi", image=encoded(np.zeros((8, 8, 3), np.uint8), "BMP")),
        "image is a BMP, not a PNG or JPEG",
        id="bmp",
    ),
    pytest.param(
        VLMRequest(prompt="hi", image=_claiming(GOOD_JPEG, 8000, 6000)),
        "image is 8000x6000; each side must be 1 to 4096",
        id="huge-jpeg",
    ),
    pytest.param(VLMRequest(prompt="", image=GOOD_PNG), "prompt is empty", id="empty-prompt"),
    pytest.param(
        VLMRequest(prompt="x" * 500, image=GOOD_PNG),
        f"prompt is 500 bytes long but the model's context of {TINY_VLM.max_context} positions",
        id="prompt-too-long",
    ),
    pytest.param(
        VLMRequest(prompt="hi", pixels=torch.zeros(3, 32, 32, dtype=torch.uint8)),
        "pixels must be a uint8 tensor of shape (height, width, 3); got uint8 of shape (3, 32, 32)",
        id="wrong-shape",
    ),
]


@pytest.mark.parametrize(("bad", "message"), BAD_REQUESTS)
async def test_a_bad_request_fails_alone_with_a_clear_stage_error(
    vlm: Pipeline, expected: list[list[int]], bad: VLMRequest, message: str
) -> None:
    """The request fails with a StageError from preprocess naming the problem; the next works."""
    with pytest.raises(StageError) as info:
        await vlm.submit(bad)
    assert info.value.stage == "preprocess"
    assert "InvalidRequest: " + message in str(info.value)
    final = await vlm.submit(INPUTS[0])
    assert final.generated_ids == expected[0]
    await wait_for(lambda: settled(vlm))


async def test_leaving_a_stream_early_aborts_it_everywhere(
    vlm: Pipeline, expected: list[list[int]]
) -> None:
    """Closing a stream after its first chunk frees every stage; later requests still match."""
    index = next(i for i, t in enumerate(expected) if len(t) == MAX_NEW_TOKENS)
    async with vlm.stream(INPUTS[index]) as stream:
        first = await anext(stream)
        assert first.token_ids == expected[index][:1]
    await wait_for(lambda: settled(vlm))
    final = await vlm.submit(INPUTS[index])
    assert final.generated_ids == expected[index]


async def test_streams_left_while_their_steps_are_batched_leave_the_rest_exact(
    vlm: Pipeline, expected: list[list[int]]
) -> None:
    """30 requests decode at once and every third is left after its first chunks: the
    others still get exactly the reference's tokens, and every stage ends up holding
    nothing."""

    async def leave_early(request: VLMRequest) -> list[int]:
        got: list[int] = []
        async with vlm.stream(request) as stream:
            async for chunk in stream:
                got += chunk.token_ids
                if len(got) >= 2:
                    break
        return got

    runs = [leave_early(r) if i % 3 == 0 else _collect(vlm, r) for i, r in enumerate(INPUTS)]
    outcomes = await asyncio.gather(*runs)
    for i, (out, want) in enumerate(zip(outcomes, expected, strict=True)):
        if i % 3 == 0:
            assert out == want[: len(out)], f"input {i}"
        else:
            assert isinstance(out, list)
            assert [t for c in out for t in c.token_ids] == want, f"input {i}"
            assert out[-1].generated_ids == want, f"input {i}"
    shared = [out[-1].timings["mean_batch"] for i, out in enumerate(outcomes) if i % 3]
    assert max(shared) > 1, shared
    await wait_for(lambda: settled(vlm))
