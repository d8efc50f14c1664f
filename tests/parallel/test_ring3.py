"""TP3 and PP3 on MLX's ring backend: three ranks over loopback, the transport every cluster
without RDMA runs. The family matrix runs its 3-rank cells under mpirun (ring's busy-polling
ranks on CI's 2 cores cost ~4x), so this keeps ring's odd world size and uneven KV heads (2 on
3 ranks) proven: greedy tokens equal one rank's and fp32 logits within 1e-4. Short traces."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_trace, tiny_prompts


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tp", "pp"])
def test_three_ring_ranks_match_one_rank(parallel, tiny_models, one_rank_trace, tmp_path):
    prompts, steps = tiny_prompts(2), 6
    want = one_rank_trace(tiny_models["llama"], prompts, steps)
    got = run_trace(
        tiny_models["llama"], tmp_path / "r3.npz", 3, parallel, prompts=prompts, max_tokens=steps
    )
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-4, rtol=1e-4)
