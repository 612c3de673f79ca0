"""The payloads of the tiny-VLM pipeline, one ``msgspec.Struct`` per hop.

::

    client ──VLMRequest──▶ preprocess ──Pixels──────▶ encode ──ImageEmbeddings──▶ prefill
                               └──────PromptTokens─────────────────────────────────▲
    prefill ──KVChunk (one per decoder layer, streamed)──▶ decode
    decode ──DecodeChunk (streamed tokens, then a final summary)──▶ client

Tensors travel out of band (see ``pipeline._codec``), so a KV chunk costs one copy of
its bytes at most, never a pickle.
"""

from __future__ import annotations

import msgspec
import torch

from pipeline import Outputs

__all__ = (
    "DecodeChunk",
    "ImageEmbeddings",
    "KVChunk",
    "Pixels",
    "PreprocessOut",
    "PromptTokens",
    "VLMRequest",
)


class VLMRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A client's request: a prompt and one image, given exactly one way.

    Attributes:
        prompt: the prompt text (UTF-8; tokenised as bytes).
        image: an encoded image, PNG or JPEG bytes.
        pixels: raw pixels, a ``uint8`` tensor of shape ``(height, width, 3)``.
    """

    prompt: str
    image: bytes = b""
    pixels: torch.Tensor | None = None


class Pixels(msgspec.Struct):
    """The encoder's input: a normalised ``float32`` tensor of shape ``(3, size, size)``."""

    values: torch.Tensor


class PromptTokens(msgspec.Struct):
    """The prompt's token ids, starting with BOS."""

    ids: list[int]


class PreprocessOut(Outputs):
    """What preprocess sends: pixels to ``encode`` and token ids to ``prefill``."""

    encode: Pixels | None = None
    prefill: PromptTokens | None = None


class ImageEmbeddings(msgspec.Struct):
    """The encoder's output: ``float32`` of shape ``(patches, d_model)``."""

    values: torch.Tensor


class KVChunk(msgspec.Struct, kw_only=True):
    """One decoder layer's KV cache after prefill, streamed in layer order.

    Attributes:
        layer: the layer's index; chunks arrive as 0, 1, 2, ...
        keys: rotated keys, ``float32`` of shape ``(heads, positions, head_dim)``.
        values: values, of the same shape as ``keys``.
        first_token: the greedy first token; only the last layer's chunk carries it,
            because it needs the output of every layer.
    """

    layer: int
    keys: torch.Tensor
    values: torch.Tensor
    first_token: int | None = None


class DecodeChunk(msgspec.Struct, kw_only=True):
    """One chunk of the client's stream; the same type for progress and the final summary.

    Attributes:
        token_ids: the tokens generated since the previous chunk (empty in the final one).
        text_delta: the text those tokens completed (UTF-8 may span chunks).
        done: True only on the final chunk, which carries the fields below.
        text: the whole generated text.
        generated_ids: every generated token, in order (EOS excluded).
        stop_reason: ``"eos"``, ``"max_new_tokens"`` or ``"context"``.
        timings: milliseconds (and tokens per second) measured by the decode stage, and
            ``mean_batch``: how many requests shared its decode steps on average.
    """

    token_ids: list[int]
    text_delta: str
    done: bool = False
    text: str = ""
    generated_ids: list[int] = msgspec.field(default_factory=list)
    stop_reason: str = ""
    timings: dict[str, float] = msgspec.field(default_factory=dict)
