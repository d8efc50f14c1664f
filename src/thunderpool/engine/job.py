"""What a rank process is asked to do: a validated JSON message from the launcher (no pickle)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from thunderpool.engine.sampling import SamplingParams
from thunderpool.parallel.layout import Layout

LAYOUT_KEYS = frozenset(f.name for f in fields(Layout))

# A rank's events for its launcher: stdout lines of this prefix and a JSON object.
EVENT_PREFIX = "TPEV "


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GenerateTask(_Frozen):
    """Stream the answer to one prompt as text events."""

    kind: Literal["generate"] = "generate"
    prompt: str
    chat: bool = True
    sampling: SamplingParams = SamplingParams()


class TraceTask(_Frozen):
    """Decode token prompts (greedy unless `sampling` says otherwise) and save every step's
    token and logits to an .npz file (equivalence tests, logprob checks)."""

    kind: Literal["trace"] = "trace"
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int = Field(32, ge=1)
    out: str
    keep_logits: bool = True
    sampling: SamplingParams = SamplingParams()


class BenchTask(_Frozen):
    """Time prefill and decode of a synthetic prompt, repeated, plus the all_sum latency."""

    kind: Literal["bench"] = "bench"
    prompt_tokens: int = Field(128, ge=1)
    max_tokens: int = Field(64, ge=2)
    repeats: int = Field(3, ge=1)
    concurrency: tuple[int, ...] = ()  # also measure continuous batching at these levels


class ServeTask(_Frozen):
    """Batch requests continuously on the leader, which takes them over the engine link."""

    kind: Literal["serve"] = "serve"
    link_host: str = "127.0.0.1"  # where the leader listens for the serve process's gateway
    model_name: str
    max_batch: int = Field(8, ge=1)
    max_context: int | None = Field(None, ge=2)
    prefix_cache_bytes: float = Field(0.0, ge=0)  # KV of kept prompts, all ranks together


Task = Annotated[GenerateTask | TraceTask | BenchTask | ServeTask, Field(discriminator="kind")]


class RankJob(_Frozen):
    model_dir: str
    world_size: int = Field(1, ge=1)
    backend: Literal["ring", "jaccl", "mpi"] = "ring"
    # Where every layer, head and expert goes, the launcher's stage and hand-off addresses, the
    # compiled step and the KV cache's format: one Layout from the plan to the loader.
    layout: Layout = Layout()
    prefill_chunk: int = Field(512, ge=1)
    draft_model: str | None = None  # the leader's draft for speculative decoding (a model dir)
    spec_k: int = Field(4, ge=1, le=64)  # draft tokens per verify step
    task: Task

    @model_validator(mode="before")
    @classmethod
    def _layout_keys(cls, data):
        # Brevity for callers: RankJob(parallel="pp", layer_split=...) builds its one Layout.
        if isinstance(data, dict) and (keys := LAYOUT_KEYS & data.keys()):
            base = data.get("layout") or Layout()
            if isinstance(base, dict):
                base = Layout(**base)
            flat = {k: data[k] for k in keys}
            data = {k: v for k, v in data.items() if k not in keys}
            data["layout"] = replace(base, **flat)
        return data

    @model_validator(mode="after")
    def _hybrid_limits(self) -> RankJob:
        # What hybrid does not run yet is refused here, before any rank starts.
        layout = self.layout
        if layout.parallel == "hybrid":
            if not layout.groups or sum(layout.groups) != self.world_size:
                raise ValueError(
                    f"hybrid groups {layout.groups} must add up to world_size {self.world_size}"
                )
            if self.draft_model:
                raise ValueError(
                    "speculative decoding does not run on hybrid TP×PP yet; drop --draft-model"
                )
            if layout.expert_split:
                raise ValueError("expert parallelism does not run inside hybrid groups yet")
        elif layout.groups:
            raise ValueError(f"groups {layout.groups} are for parallel 'hybrid' only")
        return self

    def at_stage(self, stage: int, handoff: tuple[str, ...]) -> RankJob:
        """Hybrid: this job as the ranks of `stage` run it, told every rank's hand-off address."""
        return self.model_copy(
            update={"layout": replace(self.layout, stage=stage, handoff=handoff)}
        )

    def mlx_world(self) -> int:
        """The size of this rank's MLX world: all ranks, or its stage's group (hybrid)."""
        layout = self.layout
        return layout.groups[layout.stage] if layout.groups else self.world_size
