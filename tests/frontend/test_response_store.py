"""ResponseStore's bounds with owners (API keys): each key's count is its own,
and past the byte bound the key holding the most bytes gives up its oldest."""
from __future__ import annotations

import asyncio

from fleet.frontend.response_store import ResponseStore, StoredResponse, owner_of


def stored(response_id: str, owner: str | None, text: str = "x") -> StoredResponse:
    return StoredResponse({"id": response_id, "text": text}, [], [], owner)


def ids(store: ResponseStore, owner: str | None) -> list[str]:
    return [i for i in store.entries if store.get(i, owner) is not None]


def test_another_owner_finds_nothing():
    store = ResponseStore(max_per_owner=4, max_bytes=2**20)
    store.put(stored("a1", "A"))
    assert store.get("a1", "A") is not None
    assert store.get("a1", "B") is None and store.get("a1", None) is None


def test_a_flood_of_one_owner_evicts_only_its_own():
    store = ResponseStore(max_per_owner=3, max_bytes=2**20)
    store.put(stored("a1", "A"))
    for index in range(50):
        store.put(stored(f"b{index}", "B"))
    assert ids(store, "A") == ["a1"]
    assert ids(store, "B") == ["b47", "b48", "b49"]


def test_past_the_bytes_the_largest_holder_gives_up_its_oldest():
    one = stored("a1", "A").measure()
    store = ResponseStore(max_per_owner=100, max_bytes=6 * one)
    for index in range(2):
        store.put(stored(f"a{index}", "A"))
    for index in range(20):
        store.put(stored(f"b{index}", "B"))
    assert ids(store, "A") == ["a0", "a1"]
    assert store.bytes <= store.max_bytes and len(ids(store, "B")) >= 2
    assert store.bytes == sum(entry.size for entry in store.entries.values())
    store.put(stored("a2", "A", "y" * 2 * one))  # now A holds the most: its oldest go, not B's
    assert ids(store, "A") == ["a2"] and len(ids(store, "B")) == 2
    assert sum(holding.bytes for holding in store.holdings.values()) == store.bytes <= store.max_bytes


def test_a_running_response_of_another_owner_is_not_cancelled():
    async def run() -> None:
        store = ResponseStore(max_per_owner=2, max_bytes=2**20)
        running = stored("a1", "A")
        running.task = asyncio.create_task(asyncio.sleep(60))
        store.put(running)
        for index in range(10):
            store.put(stored(f"b{index}", "B"))
        await asyncio.sleep(0)
        assert not running.task.cancelled() and store.get("a1", "A") is running
        running.task.cancel()

    asyncio.run(run())


def test_update_and_remove_keep_the_counts():
    store = ResponseStore(max_per_owner=4, max_bytes=2**20)
    entry = stored("a1", "A")
    store.put(entry)
    entry.response["text"] = "longer" * 10
    store.update("a1")
    assert store.bytes == entry.size == store.holdings["A"].bytes
    store.remove("a1")
    assert store.bytes == 0 and not store.holdings and not store.entries


def test_the_owner_is_the_keys_digest_and_only_with_keys():
    assert owner_of("Bearer k1", None) is None and owner_of("", []) is None
    digest = owner_of("Bearer k1", ["k1", "k2"])
    assert digest == owner_of("bearer  k1 ", ["k1"]) != owner_of("Bearer k2", ["k1", "k2"])
    assert "k1" not in digest and len(digest) == 64
