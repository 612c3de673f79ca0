"""A small text pipeline: split text into streamed tokens, transform them, join them back.

It exercises every shape of stage: a plain input with a streamed output (:class:`Split`),
a streamed input with a streamed output (:class:`Upper`), and a streamed input with one
output (:class:`Join`). ``configs/demo.yaml`` wires them together.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from pydantic import BaseModel, Field

from pipeline import Context, Stage, Stream

__all__ = ("Join", "Split", "Text", "Token", "Upper")


class Text(msgspec.Struct):
    """A piece of text."""

    value: str


class Token(msgspec.Struct, array_like=True):
    """One token of a text, with its position."""

    index: int
    value: str


class Split(Stage):
    """Streams the words of a text as tokens."""

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Token]:
        """Yield one token per whitespace-separated word.

        Raises:
            Nothing.
        """
        for i, word in enumerate(text.value.split()):
            yield Token(i, word)


class Upper(Stage):
    """Upper-cases each token as it arrives (optionally repeating it)."""

    class Params(BaseModel):
        repeat: int = Field(1, ge=1, le=16)

    async def process(self, tokens: Stream[Token], ctx: Context) -> AsyncIterator[Token]:
        """Yield each token upper-cased (repeated ``repeat`` times), as it arrives.

        Raises:
            ChunkGap: the next token did not arrive within the edge's chunk timeout.
        """
        assert isinstance(self.params, Upper.Params)
        async for token in tokens:
            yield Token(token.index, "-".join([token.value.upper()] * self.params.repeat))


class Join(Stage):
    """Joins streamed tokens back into one text, checking they came in order."""

    async def process(self, tokens: Stream[Token], ctx: Context) -> Text:
        """Join the tokens' words with spaces.

        Raises:
            ValueError: a token arrived out of order (the runtime guarantees it does not).
        """
        words: list[str] = []
        async for token in tokens:
            if token.index != len(words):
                raise ValueError(f"token {token.index} arrived where {len(words)} was due")
            words.append(token.value)
        return Text(" ".join(words))
