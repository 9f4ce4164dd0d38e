"""runtime/core/nesting.py: a parsed value's nesting counted as its JSON text's is, without recursion (the scan of
the text itself is tested with the servers' body reader, tests/serve/test_security.py)."""

from __future__ import annotations

import json
import random

from refusion.runtime.core.nesting import json_depth, value_depth


def test_a_values_depth_is_its_json_texts():
    rng = random.Random(0)

    def value(depth: int = 0):
        roll = rng.random()
        if depth < 8 and roll < 0.3:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        if depth < 8 and roll < 0.45:
            return tuple(value(depth + 1) for _ in range(rng.randrange(3)))
        if depth < 8 and roll < 0.7:
            return {str(i): value(depth + 1) for i in range(rng.randrange(4))}
        return rng.choice(["[{", 1, 2.5, None, True])

    for _ in range(500):
        v = value()
        assert value_depth(v) == json_depth(json.dumps(v).encode()), v
    assert value_depth("[[[") == value_depth(3) == 0 and value_depth({}) == 1 and value_depth([[], [[]]]) == 3


def test_any_depth_is_counted_and_a_value_that_holds_itself_ends_the_count():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert value_depth(deep) == 100_001
    loop: dict = {"a": [1]}
    loop["a"].append(loop)
    assert value_depth(loop) == 3  # where the loop closes; json.dumps refuses it (a circular reference)
    shared = [1]
    assert value_depth([shared, [shared]]) == 3  # a value met twice, not inside itself, is no loop
