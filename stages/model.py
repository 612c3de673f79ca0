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
    """Apply rotary positions to ``x`` of shape ``(..., positions, head_dim)``.

    Elementwise only, so rotating a batch of rows at once gives each row what rotating it
    alone gives.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def _rows(linear: nn.Linear, x: Tensor) -> Tensor:
    """``linear`` applied to each row of ``x`` ``(batch, in)`` on its own.

    One batched matmul over the weight broadcast to every row computes each row as a
    single-row product: bit-for-bit what ``linear(x[r : r + 1])`` computes, as the tests
    check. One matmul over all the rows would block the sums differently, and so round
    differently.
    """
    weight = linear.weight.t().expand(x.shape[0], -1, -1)
    out: Tensor = torch.bmm(x.unsqueeze(1), weight).squeeze(1) + linear.bias
    return out


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

    def step_many(
        self, x: Tensor, rope: tuple[Tensor, Tensor], pasts: list[LayerKV]
    ) -> tuple[Tensor, list[LayerKV]]:
        """One new position for each of several requests: row ``r`` of ``x`` extends ``pasts[r]``.

        Each row comes out bit-for-bit as :meth:`forward` computes it alone: projections
        and the MLP go row by row through :func:`_rows`, norms and activations work per
        row, and attention runs per request over its own cache.

        Args:
            x: ``(batch, d)``, one new position per request.
            rope: cos and sin of each request's position, ``(batch, 1, head_dim / 2)``.
            pasts: each request's cache of this layer.
        """
        b, d = x.shape
        qkv = _rows(self.qkv, self.norm1(x))
        q, k, v = qkv[:, :d], qkv[:, d : 2 * d], qkv[:, 2 * d :]
        shape = (b, self.n_heads, -1)
        q, k = _rotate(q.reshape(shape), *rope), _rotate(k.reshape(shape), *rope)
        v = v.reshape(shape)
        attended, caches = [], []
        for r, (past_k, past_v) in enumerate(pasts):
            kr = torch.cat((past_k, k[r].unsqueeze(1)), dim=1)
            vr = torch.cat((past_v, v[r].unsqueeze(1)), dim=1)
            attended.append(_attend(q[r].unsqueeze(1), kr, vr, None).transpose(0, 1).reshape(1, d))
            caches.append((kr, vr))
        x = x + _rows(self.out, torch.cat(attended))
        gelu = torch.nn.functional.gelu
        out: Tensor = x + _rows(self.fc2, gelu(_rows(self.fc1, self.norm2(x))))
        return out, caches


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

    @torch.inference_mode()
    def step_many(self, tokens: list[int], caches: list[list[LayerKV]]) -> list[int]:
        """:meth:`step` for several requests at once, each ``caches[r]`` extended in place.

        Every request's next token and cache are bit-for-bit those :meth:`step` gives it
        alone, whatever else is in the batch. It costs about what two or three single
        steps cost: at this model's size a step is mostly per-operation overhead, which
        the batch shares.

        Raises:
            ValueError: a cache already fills the context.
        """
        positions = [cache[0][0].shape[1] for cache in caches]
        if max(positions) >= self.config.max_context:
            raise ValueError(f"a cache already fills the context of {self.config.max_context}")
        device = caches[0][0][0].device
        x = self.embed(torch.tensor(tokens, device=device))
        at = torch.tensor(positions, device=device)
        rope = self.cos[at][:, None, :], self.sin[at][:, None, :]
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Block)
            x, layer_caches = layer.step_many(x, rope, [cache[i] for cache in caches])
            for cache, kv in zip(caches, layer_caches, strict=True):
                cache[i] = kv
        logits = _rows(self.head, self.norm(x))
        return [int(t) for t in logits.argmax(dim=-1)]


class GreedyDecoding:
    """Greedy decoding from a prefilled cache; iterate for the generated tokens.

    Shared by :func:`generate` and the decode stage so that both stop by the same rules:
    at EOS (not emitted), after ``max_new_tokens``, or when the context is full. The decode
    stage drives it a step at a time (:meth:`has_token`, :meth:`wants_step`, then a step
    of its own into ``token``); iterating does the same with :meth:`Decoder.step`.

    Attributes:
        token: the latest token, emitted unless it is EOS.
        cache: the cache, which each step extends in place.
        stop_reason: ``"eos"``, ``"max_new_tokens"`` or ``"context"`` once decoding ends.
    """

    def __init__(
        self, decoder: Decoder, first_token: int, cache: list[LayerKV], max_new_tokens: int
    ) -> None:
        if max_new_tokens < 1:
            # The first token comes from prefill: decoding always emits it, unless EOS.
            raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        self._decoder = decoder
        self.token = first_token
        self.cache = cache
        self._max = max_new_tokens
        self._produced = 0
        self.stop_reason = ""

    def has_token(self) -> bool:
        """Whether ``token`` is one to emit; False (and stopped) when it is EOS."""
        if self.token == EOS:
            self.stop_reason = "eos"
            return False
        return True

    def wants_step(self) -> bool:
        """With ``token`` emitted: whether another step is due; False (and stopped) if not."""
        self._produced += 1
        if self._produced >= self._max:
            self.stop_reason = "max_new_tokens"
            return False
        if self.cache[0][0].shape[1] >= self._decoder.config.max_context:
            self.stop_reason = "context"
            return False
        return True

    def __iter__(self) -> Iterator[int]:
        while self.has_token():
            yield self.token
            if not self.wants_step():
                return
            self.token = self._decoder.step(self.token, self.cache)


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
        max_new_tokens: the most tokens to generate, at least 1.

    Returns:
        The generated token ids, EOS excluded.

    Raises:
        ValueError: ``max_new_tokens`` is below 1.
    """
    layers = list(model.decoder.prefill(model.vision(pixels), ids))
    first = layers[-1].first_token
    assert first is not None
    decoding = GreedyDecoding(model.decoder, first, [x.kv for x in layers], max_new_tokens)
    return list(decoding)
