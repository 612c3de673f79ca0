"""The tiny VLM itself: KV-cache decoding, prefill streaming, stopping rules, determinism."""

from __future__ import annotations

import pytest
import torch

from stages.model import BOS, EOS, TINY_VLM, Decoder, GreedyDecoding, TinyVLM, generate
from stages.tokenizer import encode
from tests.stages.conftest import single_thread

SEED = 1234


def _inputs(n: int) -> list[tuple[torch.Tensor, list[int]]]:
    """``n`` random normalised images paired with different prompts."""
    print(f"seed {SEED}")
    gen = torch.Generator().manual_seed(SEED)
    prompts = ["a", "describe it", "what colour is the sky?", "é🌈 unicode", "x" * 60]
    return [
        (torch.rand(3, 32, 32, generator=gen) * 2 - 1, encode(prompts[i % len(prompts)]))
        for i in range(n)
    ]


def _full_logits(decoder: Decoder, image: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Next-token logits from a full forward pass over ``[image; ids]``, with no cache."""
    tokens = torch.tensor(ids)
    x = torch.cat((image, decoder.embed(tokens)))
    rope = (decoder.cos[: x.shape[0]], decoder.sin[: x.shape[0]])
    for layer in decoder.layers:
        x, _ = layer(x, rope)
    return decoder.logits(x[-1])


@pytest.mark.parametrize("case", range(5))
def test_kv_cache_decoding_equals_full_recompute(model: TinyVLM, case: int) -> None:
    """Each cached step's logits match a full recompute over the whole prefix, token by token."""
    pixels, ids = _inputs(5)[case]
    decoder = model.decoder
    with single_thread(), torch.no_grad():
        image = model.vision(pixels)
        layers = list(decoder.prefill(image, ids))
        cache = [layer.kv for layer in layers]
        token = layers[-1].first_token
        assert token == int(_full_logits(decoder, image, ids).argmax())
        seq = list(ids)
        for _ in range(20):
            assert token is not None
            seq.append(token)
            step_token = decoder.step(token, cache)
            full = _full_logits(decoder, image, seq)
            assert step_token == int(full.argmax())
            assert cache[0][0].shape[1] == TINY_VLM.n_patches + len(seq)
            token = step_token


def test_step_logits_are_close_to_full_recompute(model: TinyVLM) -> None:
    """The cached path computes the same function, not merely the same argmax."""
    pixels, ids = _inputs(1)[0]
    decoder = model.decoder
    with single_thread(), torch.no_grad():
        image = model.vision(pixels)
        cache = [layer.kv for layer in decoder.prefill(image, ids)]
        # Recompute the step's logits by hand: run one token through the cached layers.
        x = decoder.embed(torch.tensor([65]))
        pos = cache[0][0].shape[1]
        rope = (decoder.cos[pos : pos + 1], decoder.sin[pos : pos + 1])
        for i, layer in enumerate(decoder.layers):
            x, cache[i] = layer(x, rope, cache[i])
        torch.testing.assert_close(
            decoder.logits(x[-1]), _full_logits(decoder, image, [*ids, 65]), rtol=1e-4, atol=1e-5
        )


def test_prefill_yields_each_layer_in_order_with_the_first_token_last(model: TinyVLM) -> None:
    """Prefill yields one cache per layer, in order, shaped (heads, positions, head_dim)."""
    pixels, ids = _inputs(1)[0]
    with single_thread(), torch.no_grad():
        layers = list(model.decoder.prefill(model.vision(pixels), ids))
    assert [layer.index for layer in layers] == list(range(TINY_VLM.decoder_layers))
    assert [layer.first_token is None for layer in layers] == [True] * (len(layers) - 1) + [False]
    shape = (TINY_VLM.n_heads, TINY_VLM.n_patches + len(ids), TINY_VLM.head_dim)
    for layer in layers:
        assert tuple(layer.kv[0].shape) == tuple(layer.kv[1].shape) == shape
        assert layer.kv[0].is_contiguous() and layer.kv[1].is_contiguous()


def test_prefill_refuses_more_positions_than_the_context(model: TinyVLM) -> None:
    """A sequence longer than the context raises instead of reading past the rotary table."""
    ids = [BOS] + [65] * (TINY_VLM.max_context - TINY_VLM.n_patches)
    with pytest.raises(ValueError, match="exceed the context of 128"):
        list(model.decoder.prefill(torch.zeros(TINY_VLM.n_patches, TINY_VLM.d_model), ids))


def test_generation_is_deterministic_and_depends_on_both_inputs(model: TinyVLM) -> None:
    """Same inputs give the same tokens; changing the image or the prompt changes them."""
    (a_img, a_ids), (b_img, b_ids) = _inputs(2)
    with single_thread():
        base = generate(model, a_img, a_ids, 16)
        assert generate(model, a_img, a_ids, 16) == base
        assert generate(model, b_img, a_ids, 16) != base
        assert generate(model, a_img, b_ids, 16) != base
    assert len(base) == 16


def test_greedy_decoding_stops_at_eos_without_emitting_it(model: TinyVLM) -> None:
    """A first token of EOS ends decoding at once, with nothing generated."""
    pixels, ids = _inputs(1)[0]
    with torch.no_grad():
        cache = [layer.kv for layer in model.decoder.prefill(model.vision(pixels), ids)]
    decoding = GreedyDecoding(model.decoder, EOS, cache, 10)
    assert list(decoding) == []
    assert decoding.stop_reason == "eos"


def test_greedy_decoding_stops_at_max_new_tokens(model: TinyVLM) -> None:
    """Decoding yields exactly max_new_tokens tokens when no EOS comes first."""
    pixels, ids = _inputs(2)[1]
    with single_thread(), torch.no_grad():
        layers = list(model.decoder.prefill(model.vision(pixels), ids))
        first = layers[-1].first_token
        assert first is not None
        decoding = GreedyDecoding(model.decoder, first, [x.kv for x in layers], 3)
        assert len(list(decoding)) == 3
    assert decoding.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("budget", [0, -1])
def test_a_budget_of_no_token_is_refused(model: TinyVLM, budget: int) -> None:
    """Prefill makes the first token, so decoding emits at least one: asked for none, the
    reference generate() returned one."""
    pixels, ids = _inputs(1)[0]
    with pytest.raises(ValueError, match=f"max_new_tokens must be at least 1, not {budget}"):
        generate(model, pixels, ids, budget)


def test_greedy_decoding_stops_when_the_context_is_full(model: TinyVLM) -> None:
    """With a large budget, decoding fills the context exactly and stops there."""
    # This input's greedy continuation never reaches EOS (checked by the stop reason).
    pixels, ids = _inputs(2)[1]
    with single_thread(), torch.no_grad():
        layers = list(model.decoder.prefill(model.vision(pixels), ids))
        first = layers[-1].first_token
        assert first is not None
        cache = [x.kv for x in layers]
        decoding = GreedyDecoding(model.decoder, first, cache, 1000)
        tokens = list(decoding)
    assert decoding.stop_reason == "context"
    assert cache[0][0].shape[1] == TINY_VLM.max_context
    # The last token is chosen from the full context, so it needs no position of its own.
    assert len(tokens) == TINY_VLM.max_context - (TINY_VLM.n_patches + len(ids)) + 1
    assert EOS not in tokens
    with pytest.raises(ValueError, match="already fills the context of 128"):
        model.decoder.step(tokens[-1], cache)
