"""Which rank a lost cluster instance blames: the one killed by a signal, even when its node
reports the exit a poll later than the peer that failed because of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from thunderpool.cluster.control.instance import ClusterInstance
from thunderpool.errors import LaunchError


class ScriptedNodes:
    """Answers each node's polls from a script: a list of exit maps, the last one repeated."""

    def __init__(self, script: dict[str, list[dict[int, int | None]]]):
        self.script, self.polls = script, dict.fromkeys(script, 0)

    def client(self, node, state):
        def call(method, path, timeout):
            i = min(self.polls[node], len(self.script[node]) - 1)
            self.polls[node] += 1
            exits = self.script[node][i]
            errors = {str(r): f"rank {r} said goodbye" for r, c in exits.items() if c}
            return {"events": [], "exits": {str(r): c for r, c in exits.items()},
                    "errors": errors, "known": True}  # fmt: skip

        return SimpleNamespace(call=call)


def _instance(script) -> tuple[ClusterInstance, ScriptedNodes]:
    nodes = ScriptedNodes(script)
    inst = ClusterInstance.__new__(ClusterInstance)
    inst.coordinator, inst.state = nodes, SimpleNamespace(nodes={})
    inst.order, inst.nodes, inst.timeout = ["a", "b"], ["a", "b"], 60.0
    inst.instance_id = "x"
    inst._interrupted = SimpleNamespace(is_set=lambda: False)
    return inst, nodes


def _loss(inst) -> str:
    with pytest.raises(LaunchError) as e:
        list(inst.events())
    return str(e.value)


def test_a_signal_reported_a_poll_later_is_still_named_the_cause():
    # b's rank 1 was SIGKILLed; a's rank 0 failed on the broken link and was seen first.
    inst, _ = _instance({"a": [{0: 1}], "b": [{1: None}, {1: None}, {1: -9}]})
    assert _loss(inst).startswith("rank 1 on b exited with code -9")


def test_without_a_signal_the_lowest_failed_rank_is_named_after_the_grace():
    inst, nodes = _instance({"a": [{0: None}, {0: 1}], "b": [{1: 1}]})
    assert _loss(inst).startswith("rank 0 on a exited with code 1: rank 0 said goodbye")
    assert nodes.polls["b"] > 2  # it waited for a signal that never came


def test_a_signal_seen_at_once_ends_without_waiting():
    inst, nodes = _instance({"a": [{0: 1}], "b": [{1: -9}]})
    assert _loss(inst).startswith("rank 1 on b exited with code -9")
    assert nodes.polls == {"a": 1, "b": 1}
