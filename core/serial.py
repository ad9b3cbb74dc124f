"""The one place that turns messages into bytes and back: msgspec msgpack,
typed decoders, no pickle. A frame that does not decode as the socket's
union is counted and dropped, never executed."""
from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

import msgspec

logger = logging.getLogger(__name__)

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


class Decoder(Generic[T]):
    """A long-lived typed decoder for one socket."""

    def __init__(self, message_type: Any, socket_name: str):
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._socket_name = socket_name
        self.num_malformed = 0

    def decode(self, frame: bytes | memoryview) -> T | None:
        """The message, or None (logged and counted) for a malformed or foreign frame."""
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            self.num_malformed += 1
            logger.warning("dropped malformed frame #%d on %s: %s", self.num_malformed, self._socket_name, error)
            return None
