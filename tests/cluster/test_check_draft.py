"""fabric.check_draft: where the leader's draft comes from, asked of the leader's node before
any rank starts (a fake agent client records the questions)."""

import pytest

from thunderpool.cluster.control.state import ClusterState
from thunderpool.cluster.weights.fabric import check_draft
from thunderpool.engine.job import GenerateTask, RankJob
from thunderpool.errors import LaunchError


class _Agent:
    def __init__(self, has: bool):
        self.has, self.asked = has, []

    def call(self, method, path, req, timeout):
        self.asked.append((path, req.model, req.download))
        return {"has": self.has}


def _job(draft: str) -> RankJob:
    task = GenerateTask(prompt="Hi")
    return RankJob(model_dir="ds-v3", world_size=2, task=task, draft_model=draft, spec_k=2)


@pytest.mark.parametrize("has", [True, False])
def test_an_mtp_draft_needs_the_models_whole_files_on_the_leaders_node(has):
    agents = {"a": _Agent(has), "b": _Agent(True)}
    run = lambda: check_draft(agents.get, ClusterState(), ["a", "b"], _job("mtp"))  # noqa: E731
    if has:
        run()
    else:
        with pytest.raises(LaunchError, match=r"mtp reads the MTP layer .* leader's node a"):
            run()
    # The leader is asked for the model itself (no download), never for a model named "mtp".
    assert agents["a"].asked == [("/v1/weights/locate", "ds-v3", False)]
    assert agents["b"].asked == []


def test_a_draft_model_is_located_and_may_be_downloaded_on_the_leaders_node():
    agents = {"a": _Agent(True)}
    check_draft(agents.get, ClusterState(), ["a"], _job("org/draft"))
    assert agents["a"].asked == [("/v1/weights/locate", "org/draft", True)]
