"""The router's memory: which replica took the longest known prefix of a prompt's text."""

from __future__ import annotations

import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.serve.rayserve.prefix_owners import PrefixOwners

SYSTEM = "You are a robot arm controller. Answer with one JSON command. " * 2  # 122 characters: 3 blocks of 40


def test_a_prompt_goes_to_the_replica_that_took_its_longest_prefix() -> None:
    owners = PrefixOwners(block=40)
    owners.record(SYSTEM + "move 3", "a")
    owners.record(SYSTEM[:80] + "something else entirely, long enough", "b")
    assert owners.owner(SYSTEM + "turn 90", {"a", "b"}) == "a"  # shares 3 blocks with a's, 2 with b's
    assert owners.owner(SYSTEM[:85], {"a", "b"}) == "b"  # 2 blocks: b took them last


def test_only_live_replicas_own_and_a_dead_ones_table_is_forgotten() -> None:
    owners = PrefixOwners(block=40)
    owners.record(SYSTEM, "a")
    owners.record(SYSTEM[:40], "b")
    assert owners.owner(SYSTEM, {"b"}) == "b"  # a's longer match is not live: the next longest
    owners.forget("b")
    assert owners.owner(SYSTEM, {"b"}) is None and owners.owner(SYSTEM, {"a"}) == "a"


def test_text_shorter_than_a_block_has_no_owner() -> None:
    owners = PrefixOwners(block=40)
    owners.record("sort: 5 2 8", "a")
    assert len(owners) == 0 and owners.owner("sort: 5 2 8", {"a"}) is None


def test_the_oldest_prefixes_go_past_capacity() -> None:
    owners = PrefixOwners(block=4, capacity=3)
    owners.record("aaaabbbb", "x")
    owners.record("ccccdddd", "y")  # 4 entries: aaaa's goes
    assert len(owners) == 3
    assert owners.owner("aaaa", {"x", "y"}) is None and owners.owner("ccccdddd", {"x", "y"}) == "y"


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(RefusionError, match="block=0"):
        PrefixOwners(block=0)
