"""Makes one rank fail, for the rank-failure tests (tests/cluster/test_rank_failure.py): this
dir is put first on PYTHONPATH only in those tests' runs, so Python imports this file at the
start of every process they start, and it acts in rank processes only.

THUNDERPOOL_TEST_FAIL="load:RANK" raises while rank RANK loads its shard; "decode:RANK" raises
on its second step plan (the first after the prompt's prefill, so inside decode; a serving
rank's first request's, after its warm-up); "die:RANK"
SIGKILLs the rank there instead. The failing rank writes the wall-clock time of its failure to
the file THUNDERPOOL_TEST_FAIL_MARK names, and fails only while that file does not exist (so a
serving instance's replacement runs). The patch is installed when the engine's modules are
imported, so the launcher (which never imports them) and the other ranks run unchanged.
"""

import importlib.abc
import importlib.util
import os
import signal
import sys
import time

_SPEC = os.environ.get("THUNDERPOOL_TEST_FAIL", "")
_LOAD = _SPEC.startswith("load")
_TARGET = "thunderpool.engine.oneshot" if _LOAD else "thunderpool.engine.executor"


def _fail(group, when: str, rank: int) -> None:
    mark = os.environ["THUNDERPOOL_TEST_FAIL_MARK"]
    if group.rank() != rank or os.path.exists(mark):
        return  # another rank, or the failure happened already (a serving instance's retry)
    # When the failure happened, for the test's time-to-exit.
    with open(mark, "w") as f:
        f.write(repr(time.time()))
    if when == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected {when} failure on rank {rank}")


def _patch(module) -> None:
    when, rank = _SPEC.split(":")[0], int(_SPEC.split(":")[1])
    if when == "load":
        real_load = module.load_shard

        def load_shard(model_dir, group, *args, **kwargs):
            _fail(group, when, rank)
            return real_load(model_dir, group, *args, **kwargs)

        module.load_shard = load_shard
        return
    real_execute = module.Executor.execute
    # A serving rank counts from its first park: before it, the instance warms up (serve.py).
    calls = [0 if "thunderpool.engine.serve" not in sys.modules else None]

    def execute(self, plan, sink=None):
        if calls[0] is None:
            calls[0] = 0 if plan.op == "park" else None
            return real_execute(self, plan, sink)
        calls[0] += 1
        if calls[0] == 2:
            _fail(self.runner.group, when, rank)
        return real_execute(self, plan, sink)

    module.Executor.execute = execute


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches _TARGET right after it is first imported."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _SPEC:
    sys.meta_path.insert(0, _AfterImport())
