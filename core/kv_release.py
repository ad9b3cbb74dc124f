"""KVReleaseSender: a decode engine core tells prefill instances that it took
(or gave up) a prompt's KV, so that they free its blocks.

One PUSH socket per prefill engine address, kept for the next release to the
same producer; at most MAX_SOCKETS of them, the least recently used closed
first, so the process's open files stay bounded however many producers (or,
before the params were authenticated, made-up addresses) it hears of. Sends
never block: a producer that is gone frees its blocks after its hold timeout.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import zmq

from fleet.core import ipc, serial
from fleet.core.messages import KVRelease

logger = logging.getLogger(__name__)

MAX_SOCKETS = 32
"""Release sockets kept open (one per prefill engine: a deployment has a few)."""
SEND_HWM = 10_000
"""Releases queued per producer while it is unreachable; past that they are dropped (its hold timeout frees them)."""


class KVReleaseSender:
    def __init__(self, ctx: zmq.Context, max_sockets: int = MAX_SOCKETS):
        self._ctx = ctx
        self._max_sockets = max_sockets
        self._pushes: OrderedDict[str, zmq.Socket] = OrderedDict()

    @property
    def num_sockets(self) -> int:
        return len(self._pushes)

    def send(self, releases: list[tuple[str, str]]) -> None:
        """Send each (address, transfer id)."""
        for address, transfer_id in releases:
            try:
                self._push_to(address).send(serial.encode(KVRelease(transfer_id)), zmq.NOBLOCK)
            except zmq.ZMQError as error:  # full, or an address zmq cannot connect to
                logger.warning("could not tell %s that the KV of %s was taken: %s", address, transfer_id, error)

    def _push_to(self, address: str) -> zmq.Socket:
        push = self._pushes.pop(address, None)
        if push is None:
            push = ipc.make_socket(self._ctx, zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, SEND_HWM)
            try:
                push.connect(address)
            except zmq.ZMQError:
                push.close(linger=0)
                raise
            if len(self._pushes) >= self._max_sockets:
                _, oldest = self._pushes.popitem(last=False)
                oldest.close(linger=0)
        self._pushes[address] = push  # most recently used last
        return push

    def close(self) -> None:
        for push in self._pushes.values():
            push.close(linger=0)
        self._pushes.clear()
