"""mlx-lm's own full forward (conftest.greedy_full_forward) of many checkpoints in one child
process on the fast BLAS the ranks preload (launch/blas.py).

The test process itself runs on the mlx[cpu] wheel's bundled reference BLAS, whose GEMM is ~30x
slower: a whole family matrix's references cost over a minute there, a few seconds here. The
reference stays what it was, the unsharded mlx-lm Model.__call__ recomputing the whole sequence
at every step; only the BLAS under it changes (tests/parallel/test_blas.py proves each fast
BLAS against the bundled one).

`python fast_reference.py SPEC.json OUT_DIR`: OUT_DIR/I.npz for the I-th [dir, prompts, steps]
in SPEC.json.
"""

from __future__ import annotations

import thunderpool

if __name__ == "__main__":  # this child, not a test importing it
    thunderpool.hide_torch()

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


class FullForwards:
    """{key: (model_dir, prompts, steps)} -> {key: (tokens, logits, the parameter bytes
    mlx-lm loads)}, all in one child. The child starts at once and runs beside whatever the
    test does next (a launch of one rank takes one of CI's two cores); the first lookup waits
    for it."""

    def __init__(self, items: dict[str, tuple], tmp: Path, timeout: float = 900) -> None:
        from thunderpool.launch.blas import fast_blas_env

        tmp.mkdir(parents=True, exist_ok=True)
        spec = tmp / "spec.json"
        rows = [[str(d), [list(p) for p in ps], s] for d, ps, s in items.values()]
        spec.write_text(json.dumps(rows))
        self.keys, self.tmp, self.timeout, self.done = list(items), tmp, timeout, None
        self.log = (tmp / "child.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(spec), str(tmp)],
            env={**os.environ, **fast_blas_env()},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def result(self) -> dict:
        if self.done is None:
            try:
                code = self.proc.wait(self.timeout)
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
                self.log.close()
            assert code == 0, (self.tmp / "child.log").read_text()[-3000:]
            self.done = {}
            for i, key in enumerate(self.keys):
                data = np.load(self.tmp / f"{i}.npz")
                self.done[key] = (data["tokens"], data["logits"], int(data["bytes"]))
        return self.done

    def __getitem__(self, key):
        return self.result()[key]

    def close(self) -> None:
        """Stop a child nobody waited for (its test failed first)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def greedy_full_forwards(items: dict[str, tuple], tmp: Path, timeout: float = 900) -> dict:
    """FullForwards' results, waited for."""
    return FullForwards(items, tmp, timeout).result()


def main(spec_path: str, out_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import greedy_full_forward
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    spec = json.loads(Path(spec_path).read_text())
    for i, (model_dir, prompts, steps) in enumerate(spec):
        tokens, logits = greedy_full_forward(Path(model_dir), prompts, steps)
        model, _ = load_model(Path(model_dir), lazy=True)
        size = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        np.savez(Path(out_dir) / f"{i}.npz", tokens=tokens, logits=logits, bytes=size)


if __name__ == "__main__":
    main(*sys.argv[1:3])
