"""What a rank process is asked to do: a validated JSON message from the launcher (no pickle)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from thunderpool.engine.sampling import SamplingParams

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
    parallel: Literal["tp", "pp", "ep", "hybrid"] = "tp"
    tp_weights: tuple[float, ...] | None = None
    layer_split: tuple[int, ...] | None = None
    expert_split: tuple[int, ...] | None = None  # EP: routed experts per rank
    # EP: (layer, expert, rank) copies of hot experts on ranks besides their owner
    expert_replicas: tuple[tuple[int, int, int], ...] | None = None
    prefill_chunk: int = Field(512, ge=1)
    # Compiled decode steps where proven equal (engine/compiled.py); None: on for a CPU rank,
    # off on a GPU until a GPU run proves them (compiled.wanted).
    compile: bool | None = None
    draft_model: str | None = None  # the leader's draft for speculative decoding (a model dir)
    spec_k: int = Field(4, ge=1, le=64)  # draft tokens per verify step
    # Hybrid TP×PP: ranks per stage (each stage its own MLX world of that size); the launcher
    # sets each rank's `stage` and every rank's hand-off address (host:port, global order).
    groups: tuple[int, ...] | None = None
    stage: int = Field(0, ge=0)
    handoff: tuple[str, ...] = ()
    # KV-cache quantization (engine/kv_quant.py): every rank quantizes its own heads and
    # layers alike, from the first token; None keeps the cache at the model's float type.
    kv_bits: Literal[4, 8] | None = None
    kv_group_size: Literal[32, 64, 128] = 64
    task: Task

    @model_validator(mode="after")
    def _hybrid_limits(self) -> RankJob:
        # What hybrid does not run yet is refused here, before any rank starts.
        if self.parallel == "hybrid":
            if not self.groups or sum(self.groups) != self.world_size:
                raise ValueError(
                    f"hybrid groups {self.groups} must add up to world_size {self.world_size}"
                )
            if self.draft_model:
                raise ValueError(
                    "speculative decoding does not run on hybrid TP×PP yet; drop --draft-model"
                )
            if self.expert_split:
                raise ValueError("expert parallelism does not run inside hybrid groups yet")
        elif self.groups:
            raise ValueError(f"groups {self.groups} are for parallel 'hybrid' only")
        return self

    def mlx_world(self) -> int:
        """The size of this rank's MLX world: all ranks, or its stage's group (hybrid)."""
        return self.groups[self.stage] if self.groups else self.world_size
