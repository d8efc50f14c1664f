"""Which draft each rank holds: sharded like the target on every TP rank, or whole on the
leader.

A TP layout whose every rank reads the same draft files (a local launch, or nodes that hold
them) loads the draft cut as the target is cut; the ranks agree on that with two collectives
at load time. The shard is kept, and every rank drafts in lockstep (drafter.Shard), where a
draft token times faster so than the whole draft would on one rank: a small draft over a
fast link can lose to its collectives. Elsewhere (PP, EP, an MTP draft, a cluster whose
followers lack the files, or a sharded token that does not pay) the draft is whole on the
leader and followers hold none. THUNDERPOOL_DRAFT_SHARDS (config.py) forces either way.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

from thunderpool.config import draft_shards_choice
from thunderpool.engine.drafter import DEFAULT_K, Drafter, Shard
from thunderpool.engine.loader import Layout
from thunderpool.errors import ThunderpoolError

if TYPE_CHECKING:
    from thunderpool.engine.runner import Runner

log = logging.getLogger(__name__)
PROBE_TOKENS, PROBE_STEPS = 8, 8  # the load-time timing of a sharded draft's token


def drafter_for(job, runner: Runner, control, layout: Layout) -> Drafter | None:
    """This rank's draft for a RankJob that names one (--draft-model DIR, or mtp): every rank
    calls it at the same point, since choosing a sharded draft takes collectives."""
    if job.draft_model is None:
        return None
    if job.draft_model == "mtp":  # the model's own multi-token-prediction layer
        from thunderpool.engine.mtp import load_mtp_drafter

        return load_mtp_drafter(Path(job.model_dir), job.spec_k) if runner.is_leader else None
    draft, target = Path(job.draft_model), Path(job.model_dir)
    # Every rank of a plain TP group votes, so that all take the same branch.
    if _tp_world(runner, control, layout) and _agree(runner.group, _vote(draft, layout, control)):
        sharded = load_sharded(draft, target, job.spec_k, runner, control, layout)
        if _sharding_pays(sharded.shard.runner, control):
            return sharded
        del sharded  # each rank's shard; the leader loads the whole draft below
    if not runner.is_leader:
        return None
    return load_drafter(draft, target, job.spec_k, layout.compile)


def load_sharded(
    draft: Path, target: Path, k: int, runner: Runner, control, layout: Layout
) -> Drafter:
    """This rank's shard of the draft, cut as the target's TP layout cuts it."""
    from thunderpool.engine.loader import load_shard

    vocab = check_tokenizer(draft, target)
    own = Layout(parallel="tp", tp_weights=layout.tp_weights, compile=layout.compile)
    mine, _, _ = load_shard(draft, runner.group, own)
    return Drafter(mine.model, k, vocab, shard=Shard(mine, runner.is_leader, control.share_ints))


def _tp_world(runner: Runner, control, layout: Layout) -> bool:
    """A plain TP group of ranks (not PP, EP or hybrid): the same answer on every rank."""
    from thunderpool.engine.control import Control

    plain_tp = layout.parallel == "tp" and runner.stage is None and type(control) is Control
    return plain_tp and control.size > 1


def _vote(draft: Path, layout: Layout, control) -> int:
    """This rank's fingerprint of the draft, or -1 where it turned sharded drafts off."""
    off = draft_shards_choice() is False
    return -1 if off else _fingerprint(draft, layout, control.size)


def _sharding_pays(runner: Runner, control) -> bool:
    """Whether the sharded draft's token is faster than the whole draft's on one rank would
    be: timed in lockstep with its collectives, against this rank's shard timed alone times
    the ranks (a whole draft reads every shard). A small draft over a fast, low-latency link
    can lose to its collectives. The leader's verdict, on every rank."""
    from thunderpool.engine.measure import solo_step_ms, step_ms

    prompt = list(range(1, PROBE_TOKENS + 1))
    sharded = step_ms(runner, prompt, PROBE_STEPS, 1, 1)  # the median skips the first's trace
    whole = solo_step_ms(runner, prompt, PROBE_STEPS, 1, 1) * control.size
    log.info("draft token: sharded %.2f ms, whole on one rank ~%.2f ms", sharded, whole)
    # Every rank times (the collectives' order); THUNDERPOOL_DRAFT_SHARDS=1 on the leader
    # overrides the verdict.
    verdict = draft_shards_choice() is True or sharded < whole
    return control.share_ints([int(verdict)] if runner.is_leader else None, 1)[0] == 1


def _fingerprint(draft: Path, layout: Layout, ranks: int) -> int:
    """The draft files as this rank reads them (config bytes, weight file names and sizes), or
    -1 where it cannot read them or the target's TP split cannot cut them."""
    from thunderpool.engine.loader import preflight

    try:
        config = (draft / "config.json").read_bytes()
        files = sorted((f.name, f.stat().st_size) for f in draft.glob("*.safetensors"))
        preflight(draft, ranks, Layout(tp_weights=layout.tp_weights))
    except (OSError, ValueError, ThunderpoolError):
        return -1
    return zlib.crc32(config + repr(files).encode()) & 0x7FFFFFFF


def _agree(group: mx.distributed.Group, mine: int) -> bool:
    """Whether every rank reads the leader's draft files (two all_sums)."""
    size = group.size()

    def total(values: list[int]) -> list[int]:
        summed = mx.distributed.all_sum(mx.array(values, mx.int32), group=group, stream=mx.cpu)
        return summed.tolist()

    first = [mine if group.rank() == 0 else 0] + [0] * (size - 1)  # one element per rank
    lead = total(first)[0]
    same = [int(mine >= 0 and mine == lead)] + [0] * (size - 1)
    return total(same)[0] == size


def load_drafter(
    draft_dir: Path, target_dir: Path, k: int = DEFAULT_K, compile: bool | None = None
) -> Drafter:
    """The draft model, whole on this rank, after checking that it speaks the target's
    tokenizer: the same token-to-id map where both ship a tokenizer, else the same vocab size."""
    from mlx_lm.utils import load_model

    vocab = check_tokenizer(draft_dir, target_dir)
    model, _ = load_model(draft_dir)
    return Drafter(model, k, vocab, compile=compile)


def check_tokenizer(draft_dir: Path, target_dir: Path) -> int:
    """The target's vocabulary size, after checking that the draft speaks its tokenizer."""
    from thunderpool.engine.loader import read_config

    draft_cfg, target_cfg = read_config(draft_dir), read_config(target_dir)
    vocab = _vocab_size(target_cfg)
    has = [(d / "tokenizer.json").is_file() for d in (draft_dir, target_dir)]
    if all(has):
        mine, theirs = _token_ids(draft_dir), _token_ids(target_dir)
        if mine != theirs:
            differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
            raise ThunderpoolError(
                f"--draft-model {draft_dir} has another tokenizer than the model {target_dir} "
                f"(e.g. {differ}); pick a draft of the same model family and tokenizer"
            )
    elif any(has) or _vocab_size(draft_cfg) != vocab:
        raise ThunderpoolError(
            f"--draft-model {draft_dir} (vocab {_vocab_size(draft_cfg)}) cannot be checked "
            f"against the tokenizer of {target_dir} (vocab {vocab}); a draft must share the "
            "model's tokenizer files, or (without any) its vocabulary size"
        )
    return vocab


def _vocab_size(config: dict) -> int:
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0))


def _token_ids(model_dir: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab()
