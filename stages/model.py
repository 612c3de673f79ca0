"""A tiny, deterministic vision-language model: the reference the stages are checked against.

:data:`TINY_VLM` is a 32x32 RGB image cut into 16 patches of 8x8, a two-block vision
transformer (width 64, 4 heads, learned positions) projected into the decoder's width, and
a three-layer causal decoder (width 64, 4 heads, rotary positions, a KV cache) over a byte
vocabulary plus BOS and EOS, with a context of 128 positions. The decoder reads
``[image embeddings; BOS; prompt bytes]`` and decodes greedily.

Everything is ``float32`` with explicit matmuls (no fused attention kernel whose choice
might depend on shape), and rotary angles come from one table, so a stage in another
process computes bit-for-bit what :func:`generate` computes here, given the same number of
threads. The weights are random, from a fixed seed (see :mod:`stages.weights`): the model
says nothing sensible, but deterministically so, and its output depends on both inputs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import torch
from torch import Tensor, nn

__all__ = (
    "BOS",
    "EOS",
    "TINY_VLM",
    "Decoder",
    "GreedyDecoding",
    "LayerKV",
    "PrefillLayer",
    "TinyVLM",
    "VLMConfig",
    "VisionEncoder",
    "generate",
)

#: Token ids 0-255 are bytes; these two follow them.
BOS = 256
EOS = 257

#: One layer's cache: keys (already rotated) and values, each ``(heads, positions, head_dim)``.
LayerKV = tuple[Tensor, Tensor]


class VLMConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The model's shape; stored in the weights file's header and checked on load."""

    image_size: int = 32
    patch_size: int = 8
    channels: int = 3
    d_model: int = 64
    n_heads: int = 4
    encoder_layers: int = 2
    decoder_layers: int = 3
    mlp_ratio: int = 4
    vocab_size: int = 258
    max_context: int = 128
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def n_patches(self) -> int:
        """Image tokens per image."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def max_prompt_bytes(self) -> int:
        """The longest prompt that leaves room, after the image and BOS, for one more token."""
        return self.max_context - self.n_patches - 2


TINY_VLM = VLMConfig()


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Scaled dot-product attention over ``(heads, positions, head_dim)`` tensors."""
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply rotary positions to ``x`` of shape ``(heads, positions, head_dim)``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Block(nn.Module):
    """A pre-norm transformer block; ``rope`` and ``causal`` make it a decoder layer."""

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.norm1 = nn.LayerNorm(d, eps=config.norm_eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, eps=config.norm_eps)
        self.fc1 = nn.Linear(d, config.mlp_ratio * d)
        self.fc2 = nn.Linear(config.mlp_ratio * d, d)

    def _heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Project ``x`` of shape ``(positions, d)`` to q, k, v of ``(heads, positions, hd)``."""
        q, k, v = self.qkv(self.norm1(x)).split(x.shape[-1], dim=-1)
        shape = (x.shape[0], self.n_heads, -1)
        # contiguous() so that the cache ships as a view of its own memory, never a copy.
        q, k, v = (t.reshape(shape).transpose(0, 1).contiguous() for t in (q, k, v))
        return q, k, v

    def _finish(self, x: Tensor, attended: Tensor) -> Tensor:
        """Merge heads, add the residual, and apply the MLP."""
        x = x + self.out(attended.transpose(0, 1).reshape(x.shape))
        out: Tensor = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))
        return out

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None = None,
        past: LayerKV | None = None,
    ) -> tuple[Tensor, LayerKV]:
        """Run the block over ``x`` of shape ``(positions, d)``.

        Args:
            x: the new positions' hidden states.
            rope: cos and sin for the new positions; None for the (unrotated) encoder.
            past: the cache of earlier positions; with it no mask is needed, because the
                new position is the last one and may see everything.

        Returns:
            The new hidden states and this layer's whole cache (past plus new positions).
        """
        q, k, v = self._heads(x)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        mask = None
        if past is not None:
            k, v = torch.cat((past[0], k), dim=1), torch.cat((past[1], v), dim=1)
        elif rope is not None:
            n = x.shape[0]
            mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        return self._finish(x, _attend(q, k, v, mask)), (k, v)


class VisionEncoder(nn.Module):
    """Pixels ``(3, size, size)`` to image embeddings ``(patches, d_model)``."""

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.config = config
        p = config.patch_size
        self.patch = nn.Linear(config.channels * p * p, config.d_model)
        self.pos = nn.Parameter(torch.zeros(config.n_patches, config.d_model))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.encoder_layers))
        self.norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.proj = nn.Linear(config.d_model, config.d_model)

    # Inference mode here, not only in generate(): the stages call these directly, and
    # without it every op records autograd metadata (about 1.2x slower on the decode loop).
    @torch.inference_mode()
    def forward(self, pixels: Tensor) -> Tensor:
        """Embed one normalised image of shape ``(channels, size, size)``."""
        c, p = self.config.channels, self.config.patch_size
        g = self.config.image_size // p
        patches = pixels.reshape(c, g, p, g, p).permute(1, 3, 0, 2, 4).reshape(g * g, c * p * p)
        x = self.patch(patches) + self.pos
        for block in self.blocks:
            x, _ = block(x)
        out: Tensor = self.proj(self.norm(x))
        return out


@dataclass(frozen=True, slots=True)
class PrefillLayer:
    """One decoder layer's result during prefill; the last one also has the first token."""

    index: int
    kv: LayerKV
    first_token: int | None


class Decoder(nn.Module):
    """The causal decoder: prefill layer by layer, then one token at a time from a cache."""

    cos: Tensor
    sin: Tensor

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.decoder_layers))
        self.norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size)
        # One table for every position: prefill and single steps then read identical angles.
        half = config.head_dim // 2
        inv = config.rope_base ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(config.max_context, dtype=torch.float64)[:, None] * inv
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def _rope(self, start: int, n: int) -> tuple[Tensor, Tensor]:
        return self.cos[start : start + n], self.sin[start : start + n]

    def logits(self, h_last: Tensor) -> Tensor:
        """The next-token logits for the last position's hidden state."""
        out: Tensor = self.head(self.norm(h_last))
        return out

    def _next_token(self, h_last: Tensor) -> int:
        """Greedy choice; argmax takes the lowest id among ties, deterministically."""
        return int(self.logits(h_last).argmax())

    # Inference mode here, not only in generate(): the stages call these directly, and
    # without it every op records autograd metadata (about 1.2x slower on the decode loop).
    @torch.inference_mode()
    def prefill(self, image: Tensor, ids: list[int]) -> Iterator[PrefillLayer]:
        """Run ``[image; ids]`` through the layers, yielding each layer's cache when done.

        Yielding per layer lets a caller ship layer ``i`` before layer ``i + 1`` computes.

        Raises:
            ValueError: the image and tokens together exceed the context.
        """
        tokens = torch.tensor(ids, dtype=torch.long, device=image.device)
        x = torch.cat((image, self.embed(tokens)), dim=0)
        if x.shape[0] > self.config.max_context:
            raise ValueError(
                f"{x.shape[0]} positions exceed the context of {self.config.max_context}"
            )
        rope = self._rope(0, x.shape[0])
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, rope)
            yield PrefillLayer(i, kv, self._next_token(x[-1]) if i == last else None)

    # Inference mode here, not only in generate(): the stages call these directly, and
    # without it every op records autograd metadata (about 1.2x slower on the decode loop).
    @torch.inference_mode()
    def step(self, token: int, cache: list[LayerKV]) -> int:
        """Feed one token, extending ``cache`` in place; returns the next greedy token.

        Raises:
            ValueError: the cache already fills the context.
        """
        pos = cache[0][0].shape[1]
        if pos >= self.config.max_context:
            raise ValueError(f"the cache already fills the context of {self.config.max_context}")
        x = self.embed(torch.tensor([token], device=cache[0][0].device))
        rope = self._rope(pos, 1)
        for i, layer in enumerate(self.layers):
            x, cache[i] = layer(x, rope, cache[i])
        return self._next_token(x[-1])


class GreedyDecoding:
    """Greedy decoding from a prefilled cache; iterate for the generated tokens.

    Shared by :func:`generate` and the decode stage so that both stop by the same rules:
    at EOS (not emitted), after ``max_new_tokens``, or when the context is full.

    Attributes:
        stop_reason: ``"eos"``, ``"max_new_tokens"`` or ``"context"`` once iteration ends.
    """

    def __init__(
        self, decoder: Decoder, first_token: int, cache: list[LayerKV], max_new_tokens: int
    ) -> None:
        self._decoder = decoder
        self._token = first_token
        self._cache = cache
        self._max = max_new_tokens
        self.stop_reason = ""

    def __iter__(self) -> Iterator[int]:
        produced = 0
        while True:
            if self._token == EOS:
                self.stop_reason = "eos"
                return
            yield self._token
            produced += 1
            if produced >= self._max:
                self.stop_reason = "max_new_tokens"
                return
            if self._cache[0][0].shape[1] >= self._decoder.config.max_context:
                self.stop_reason = "context"
                return
            self._token = self._decoder.step(self._token, self._cache)


class TinyVLM(nn.Module):
    """Both parts together, for the single-process reference."""

    def __init__(self, config: VLMConfig = TINY_VLM) -> None:
        super().__init__()
        self.config = config
        self.vision = VisionEncoder(config)
        self.decoder = Decoder(config)


@torch.inference_mode()
def generate(model: TinyVLM, pixels: Tensor, ids: list[int], max_new_tokens: int) -> list[int]:
    """The monolithic reference: encode, prefill and decode greedily in this process.

    Args:
        model: the loaded model.
        pixels: a normalised image, ``(3, size, size)``.
        ids: the prompt's token ids, BOS first.
        max_new_tokens: the most tokens to generate.

    Returns:
        The generated token ids, EOS excluded.
    """
    layers = list(model.decoder.prefill(model.vision(pixels), ids))
    first = layers[-1].first_token
    assert first is not None
    decoding = GreedyDecoding(model.decoder, first, [x.kv for x in layers], max_new_tokens)
    return list(decoding)
