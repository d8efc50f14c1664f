"""Tokens reach the client as they are made (issue 28 item 6): over a 700-token stream of the
embedded model, no gap between two SSE chunks after the first decode step exceeds 3x the median gap
plus 100 ms, on `serve --nodes 2` with its default backend. MPI ranks that spun beside the
gateway on a 2-core machine starved it of CPU (gaps of 2-12 s, while every token left the
leader on time); serve now takes ring there. On a fresh machine the first steps also waited for
MLX's C++ compiler to build the step's CPU kernels (a 3.5-4.7 s gap), and a rank's full garbage
collection held its step (0.15 s); an instance now warms up before it says ready, and every rank
freezes its loaded objects (engine/serve.py). Shapes, not times. The same rule on the testbed's
`serve --cluster`: tests/cluster/test_cluster_stream_gaps.py.
"""

from __future__ import annotations

import pytest
from serving import serving
from stream_gaps import assert_on_time, chunk_times


@pytest.mark.slow
def test_serve_streams_each_token_as_it_is_made():
    with serving("--nodes", "2") as served:
        assert_on_time(chunk_times(served.url))
