"""The byte-level tokenizer: token ids 0-255 are the prompt's UTF-8 bytes, then BOS and EOS.

Decoding is incremental, because a streamed chunk may end inside a multi-byte character:
:class:`TextStream` holds the incomplete bytes back until the next chunk completes them.
"""

from __future__ import annotations

import codecs

from stages.model import BOS

__all__ = ("TextStream", "encode")


def encode(prompt: str) -> list[int]:
    """The token ids of ``prompt``: BOS, then its UTF-8 bytes."""
    return [BOS, *prompt.encode("utf-8")]


class TextStream:
    """Turns generated token ids into text, chunk by chunk.

    Special tokens (BOS, EOS) have no text. Invalid UTF-8, which a random model produces
    freely, becomes U+FFFD rather than an error.
    """

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: list[int]) -> str:
        """The text that ``ids`` complete."""
        return self._decoder.decode(bytes(i for i in ids if i < 256))

    def flush(self) -> str:
        """The text of any bytes still held back, at the end of the stream."""
        return self._decoder.decode(b"", final=True)
