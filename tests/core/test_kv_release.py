"""KVReleaseSender (core/kv_release.py): releases reach their producer over
real ZMQ sockets, and however many producer addresses a decode engine hears
of, its open files stay flat."""
from __future__ import annotations

import time

import psutil
import zmq

from fleet.core import serial
from fleet.core.kv_release import MAX_SOCKETS, KVReleaseSender
from fleet.core.messages import KVRelease


def test_releases_reach_the_producer():
    ctx = zmq.Context()
    producer = ctx.socket(zmq.PULL)
    address = f"tcp://127.0.0.1:{producer.bind_to_random_port('tcp://127.0.0.1')}"
    sender = KVReleaseSender(ctx)
    try:
        sender.send([(address, "a" * 32), (address, "b" * 32)])
        assert producer.poll(10_000)
        decoder = serial.Decoder(KVRelease, "test releases")
        received = [decoder.decode(producer.recv()).transfer_id for _ in range(2)]
        assert received == ["a" * 32, "b" * 32] and sender.num_sockets == 1
    finally:
        sender.close()
        producer.close(linger=0)
        ctx.term()


def test_open_files_stay_flat_over_10000_requests_to_distinct_addresses():
    ctx = zmq.Context()
    sender = KVReleaseSender(ctx)
    process = psutil.Process()
    try:
        sender.send([("tcp://127.0.0.1:1", "0" * 32)])
        before = process.num_fds()
        for index in range(10_000):  # nothing listens there: each socket only queues its message
            sender.send([(f"tcp://127.0.0.{1 + index // 60_000}:{1024 + index % 60_000}", f"{index:032x}")])
            if index % 1000 == 999:
                assert fds_fall_to(process, before + 2 * MAX_SOCKETS)
        sender.send([("not an address", "0" * 32), ("tcp://", "0" * 32)])  # refused by zmq, nothing kept
        assert sender.num_sockets == MAX_SOCKETS
    finally:
        sender.close()
        ctx.term()
    assert fds_fall_to(process, before)


def fds_fall_to(process: psutil.Process, count: int, timeout: float = 30.0) -> bool:
    """zmq closes a socket's files on its own thread, a little after close(): wait for it."""
    deadline = time.monotonic() + timeout
    while process.num_fds() > count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
