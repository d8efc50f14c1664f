"""One forward of a batch on this rank, the same call for single, TP and PP layouts."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from thunderpool.engine import attention, compiled, fused, kmajor, kv_quant, rowsplit
from thunderpool.parallel.anatomy import anatomy
from thunderpool.parallel.pipeline import PipelineStage
from thunderpool.parallel.vocab import has_split_head


class Runner:
    """Runs the local part of the model; the leader (rank 0) gets the last position's logits
    (and so does every TP rank, through the split output head's all_gather)."""

    def __init__(
        self,
        model: nn.Module,
        group: mx.distributed.Group,
        stage: PipelineStage | None,
        compile: bool = True,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
    ):
        self.model, self.group, self.stage = model, group, stage
        self.anatomy = anatomy(model)  # the decoder, wherever this family keeps it
        # --kv-bits: every cache this rank makes is quantized alike (engine/kv_quant.py).
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.rank, self.size = group.rank(), group.size()
        # Hybrid: rank 0 of a later stage's world is no leader (stage.leads says who is).
        self.is_leader = self.rank == 0 if stage is None else stage.leads
        # Leader with an MTP draft (engine/mtp.py): keep each forward's final hidden states.
        self.keep_hidden = False
        self.hidden: mx.array | None = None  # (B, L, D) of the last forward, when kept
        self.every_position = False  # PP, every rank alike: prefill hands over all positions
        # TP ranks each project onto their part of the vocabulary, then all_gather the logits
        # (hybrid: stage 0's group, the only one that holds the head).
        self.every_rank_projects = (
            has_split_head(model) or self.anatomy.head_gathers(model)
        ) and (stage is None or stage.rank == 0)
        # Decode steps replay one compiled graph where that is proven equal (engine/compiled.py),
        # its products split over a CPU rank's cores (engine/rowsplit.py).
        self.compiled, self.ways, self.head = None, 1, None
        self.kmajor = kmajor.wanted()
        if self.kmajor:  # few-row products (verify, batches) near one row's cost on a CPU
            kmajor.turn(model, rowsplit.ways())
        if compile and compiled.supports(model):
            self.ways = rowsplit.ways()
            self.compiled = compiled.build(model, self._finish, stage, self.ways, self._every)
        if self.compiled is not None and not has_split_head(model):
            self.head = fused.head(model, self.ways)

    def make_cache(self) -> list:
        caches = make_prompt_cache(self.model)
        if self.kv_bits is None:
            return caches
        local = self.stage.local if self.stage is not None else None
        return kv_quant.quantize(caches, self.kv_bits, self.kv_group_size, local)

    def forward(self, tokens: mx.array, cache: list) -> mx.array | None:
        """tokens (B, L) -> logits (B, V) on the leader; on followers, what must be evaluated."""
        self._blas(tokens)
        with attention.cpu_prefill(self.model):
            if self.stage is not None:
                h = self.stage.forward(tokens, cache, last_only=not self.every_position)
            else:
                h = self.anatomy.hidden(tokens, cache)
        return self._finish(h)

    def _blas(self, tokens: mx.array) -> None:
        """BLIS on one thread where this forward's products split over the streams (few rows
        of input-major weights), the process's setting otherwise."""
        if self.compiled is not None or self.kmajor:
            rowsplit.blas_threads(one_row=self.kmajor and kmajor.split_rows(tokens.size))

    def decode(self, tokens: mx.array, cache: list) -> mx.array | None:
        """One step of tokens (B, 1): `forward`, compiled where the model and cache allow."""
        if self.compiled is not None and compiled.eligible(cache) and not self.keep_hidden:
            rowsplit.blas_threads(one_row=True)
            if self.stage is not None:
                return self._finish(self.stage.decode(tokens, cache, self.compiled.decode))
            return self.compiled.decode(tokens, cache)
        return self.forward(tokens, cache)

    def _finish(self, h: mx.array | None) -> mx.array | None:
        """The last position's logits on ranks that project; h (or None) elsewhere."""
        if h is None:
            return None
        if self.keep_hidden:
            self.hidden = h
        h = h[:, -1:, :]
        if not (self.is_leader or self.every_rank_projects):
            return h  # TP followers evaluate the same all_sums as the leader; PP ones get None
        return self.project(h)[:, -1, :]

    def verify(self, tokens: mx.array, cache: list) -> mx.array | None:
        """tokens (B, L) -> logits (B, L, V) of every position on the leader (a speculative
        verify step); on followers, what must be evaluated. A few-row window replays a
        compiled graph where the decode step does (not under PP, nor with MTP's hidden
        states)."""
        c = self.compiled
        if (
            c is not None
            and c.windows
            and compiled.eligible(cache)
            and not self.keep_hidden
            and kmajor.split_rows(tokens.size)
        ):
            rowsplit.blas_threads(one_row=True)  # the graph's products split over the streams
            return c.verify(tokens, cache)
        self._blas(tokens)
        with attention.cpu_prefill(self.model):
            if self.stage is not None:
                h = self.stage.forward(tokens, cache, last_only=False)
            else:
                h = self.anatomy.hidden(tokens, cache)
        if self.keep_hidden:
            self.hidden = h
        return self._every(h)

    def _every(self, h: mx.array) -> mx.array:
        """Every position's logits on ranks that project; h elsewhere."""
        if not (self.is_leader or self.every_rank_projects):
            return h
        return self.project(h)

    def project(self, h: mx.array) -> mx.array:
        """The output head: the model's own __call__ after its decoder (parallel/anatomy.py),
        so logit scaling and soft-capping are the family's, through the vocabulary-split head
        (TP) too; the core-split head of a compiled decode is the same product."""
        if self.head is None:
            return self.anatomy.head(self.model, h)
        logits = self.head(h)
        # Gemma-2-style models soft-cap their logits inside Model.__call__, which we bypass.
        cap = getattr(getattr(self.model, "args", None), "final_logit_softcapping", None)
        return mx.tanh(logits / cap) * cap if cap else logits
