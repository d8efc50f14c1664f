"""Which decode step a job asks for when the flags leave it unset (cli/jobs.rank_job): serve
decodes eagerly (the compiled step's memory grows under its load; README), one-shot jobs keep
the default, and --compile / --no-compile always win."""

from __future__ import annotations

import argparse

import pytest

from thunderpool.cli.jobs import rank_job
from thunderpool.engine.job import GenerateTask, ServeTask
from thunderpool.parallel.layout import Layout


def _args(compile_: bool | None) -> argparse.Namespace:
    return argparse.Namespace(compile=compile_, prefill_chunk=512)


@pytest.mark.parametrize(
    ("task", "world", "flag", "expected"),
    [
        (ServeTask(model_name="m"), 2, None, False),
        (ServeTask(model_name="m"), 1, None, False),
        (ServeTask(model_name="m"), 2, True, True),
        (ServeTask(model_name="m"), 1, False, False),
        (GenerateTask(prompt="hi"), 2, None, None),
    ],
)
def test_compile_default(task, world, flag, expected):
    job = rank_job(_args(flag), task, world, Layout(), "/m")
    assert job.layout.compile is expected
