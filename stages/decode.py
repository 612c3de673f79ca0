"""The ``decode`` stage: rebuilds the KV cache from prefill's stream, then decodes greedily,
streaming tokens to the client as they are produced and ending with a summary chunk.

The cache is consumed layer by layer as it arrives and checked for order and completeness.
The first token goes out alone, so the time to first token never waits for a full chunk.
After it, a chunk leaves when it holds ``chunk_tokens`` tokens, or when waiting for one
more token (taking as long as the last one took) would keep its oldest token past
``chunk_ms``: a fast model sends fewer, fuller chunks (each wakes the client), and a slow
one sends each token as it is made.
The last chunk (``done=True``) carries the full text, every generated id, why generation
stopped, and wall-clock timings.

Requests that decode at the same time share their steps (see :mod:`stages.step_batcher`):
up to ``max_batch`` requests' next tokens come from one batched step, bit-for-bit the
tokens each would get alone.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import torch
from pydantic import BaseModel, ConfigDict, Field

from pipeline import Context, Stream
from stages.decoder_stage import DecoderStage
from stages.model import TINY_VLM, GreedyDecoding, LayerKV
from stages.payloads import DecodeChunk, KVChunk
from stages.step_batcher import StepBatcher
from stages.tokenizer import TextStream

__all__ = ("Decode",)


class Decode(DecoderStage):
    """Greedy decoding from a streamed KV cache; loads only the decoder's weights."""

    class Params(BaseModel):
        """Decode settings.

        Attributes:
            max_new_tokens: the most tokens generated per request.
            chunk_tokens: the most tokens one streamed chunk holds (after the first token,
                which goes alone).
            chunk_ms: the longest a token is held back to share a chunk: a chunk leaves,
                full or not, when waiting for the next token would keep its oldest
                token longer (milliseconds; 0 sends every token as it is made).
            max_batch: the most requests whose decode steps run as one (1: never batch).
        """

        model_config = ConfigDict(extra="forbid")

        max_new_tokens: int = Field(32, ge=1, le=TINY_VLM.max_context)
        chunk_tokens: int = Field(16, ge=1, le=TINY_VLM.max_context)
        chunk_ms: float = Field(20.0, ge=0.0, le=60_000.0)
        max_batch: int = Field(8, ge=1, le=256)

    batcher: StepBatcher

    async def setup(self) -> None:
        """Load the decoder's weights and start batching steps.

        Raises:
            WeightsError: the weights file is malformed or fails verification.
        """
        await super().setup()
        params = self.params
        assert isinstance(params, Decode.Params)
        self.batcher = StepBatcher(self.decoder, params.max_batch)

    def statistics(self) -> dict[str, int | float]:
        """Decode steps run, and how many requests' steps each held on average."""
        b = self.batcher
        return {"steps": b.steps, "mean_batch": b.request_steps / b.steps if b.steps else 0.0}

    async def _receive(self, kv: Stream[KVChunk]) -> tuple[list[LayerKV], int]:
        """The whole cache and the first token, checked for order and completeness."""
        cache: list[LayerKV] = []
        first: int | None = None
        config = TINY_VLM
        positions: int | None = None
        async for chunk in kv:
            if chunk.layer != len(cache):
                raise ValueError(f"KV for layer {chunk.layer} arrived where {len(cache)} was due")
            # Checked here, where a bad request fails alone: in a batched step its error
            # would reach every request of the batch.
            for name, t in (("keys", chunk.keys), ("values", chunk.values)):
                if positions is None:
                    positions = t.shape[1] if t.dim() == 3 else 0
                expected = (config.n_heads, positions, config.head_dim)
                if t.dtype != torch.float32 or tuple(t.shape) != expected:
                    raise ValueError(
                        f"KV layer {chunk.layer} {name} must be float32 of shape {expected} "
                        f"(heads, positions, head_dim); got {t.dtype} of shape {tuple(t.shape)}"
                    )
            cache.append((chunk.keys.to(self.device), chunk.values.to(self.device)))
            first = chunk.first_token
        if positions is not None and not 0 < positions <= config.max_context:
            raise ValueError(
                f"the KV cache holds {positions} positions, where the context holds 1 to "
                f"{config.max_context}"
            )
        if len(cache) != TINY_VLM.decoder_layers:
            raise ValueError(f"prefill sent {len(cache)} of {TINY_VLM.decoder_layers} KV layers")
        if first is None:
            raise ValueError("prefill's last KV chunk carried no first token")
        return cache, first

    async def process(self, kv: Stream[KVChunk], ctx: Context) -> AsyncIterator[DecodeChunk]:
        """Stream the generated tokens, then a final summary chunk.

        Raises:
            ValueError: the KV stream is out of order or incomplete.
            ChunkGap: a KV chunk did not arrive within the edge's chunk timeout.
        """
        params = self.params
        assert isinstance(params, Decode.Params)
        t0 = time.perf_counter()
        cache, first = await self._receive(kv)
        t_kv = time.perf_counter()
        decoding = GreedyDecoding(self.decoder, first, cache, params.max_new_tokens)
        text = TextStream()
        parts: list[str] = []
        generated: list[int] = []
        pending: list[int] = []
        # When the oldest pending token and the latest token were made.
        oldest = made = time.perf_counter()
        budget_s = params.chunk_ms / 1e3
        t_first = t_kv
        steps = shared = 0
        model_s = 0.0
        batcher = self.batcher
        with batcher.decoding():
            while decoding.has_token():
                token = decoding.token
                generated.append(token)
                now = time.perf_counter()
                gap, made = now - made, now  # the next token likely takes as long
                if not pending:
                    oldest = now
                pending.append(token)
                if (
                    len(generated) == 1
                    or len(pending) >= params.chunk_tokens
                    or now + gap - oldest >= budget_s
                ):
                    parts.append(delta := text.push(pending))
                    if len(generated) == 1:
                        t_first = now
                    yield DecodeChunk(token_ids=pending, text_delta=delta)
                    pending = []
                if not decoding.wants_step():
                    break
                # The step yields to the loop (every step while others decode, every few
                # ms alone): other requests' steps interleave and an abort is noticed.
                decoding.token, batch, ran = await batcher.step(token, cache)
                steps += 1
                shared += batch
                model_s += ran
        if pending:
            parts.append(delta := text.push(pending))
            yield DecodeChunk(token_ids=pending, text_delta=delta)
        tail = text.flush()
        t_end = time.perf_counter()
        decode_s = t_end - t_kv
        yield DecodeChunk(
            token_ids=[],
            text_delta=tail,
            done=True,
            text="".join(parts) + tail,
            generated_ids=generated,
            stop_reason=decoding.stop_reason,
            timings={
                "kv_receive_ms": (t_kv - t0) * 1e3,
                "first_token_ms": (t_first - t0) * 1e3,
                "decode_ms": decode_s * 1e3,
                "tokens_per_s": len(generated) / decode_s if decode_s > 0 else 0.0,
                # Time in the model steps that made this request's tokens (batched steps
                # whole); the rest of decode_ms is the runtime's and the loop's.
                "model_ms": model_s * 1e3,
                # How many requests shared this request's steps, on average (1: alone).
                "mean_batch": shared / steps if steps else 1.0,
            },
        )
