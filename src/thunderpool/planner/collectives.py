"""What a layout's collectives add to a decode step and a prefill: TP's all-reduces and the split
vocabulary's exchanges, the leader's per-step command, PP's hand-offs; each on the link that
sets its pace."""

from __future__ import annotations

from thunderpool.errors import ThunderpoolError
from thunderpool.planner.hardware import CONTROL_BYTES, LinkSpec, link_between
from thunderpool.planner.spec import ModelSpec


def tp_collectives(
    spec: ModelSpec,
    group: tuple[str, ...],
    n_layers: int,
    links: list[LinkSpec],
    n: int,
    batch: int,
    prompt_tokens: int,
    act_bytes: float,
    whole: bool,
) -> tuple[list[float], list[float]]:
    """A TP stage's collectives (its nodes `group` run `n_layers`), as (decode step, prefill)
    seconds in the order they add up:
    2 all-reduces per layer; a stage that is the whole layout (`whole`) also splits the
    vocabulary (parallel/vocab.py): the embedding's all_sum and the logits' gather."""
    hidden = spec.hidden
    # Each message on the group's slowest link for its size: a small all-reduce waits on
    # latency, the logits' gather on bandwidth, which two different links may set.
    step, prompt = batch * hidden * act_bytes, prompt_tokens * hidden
    link = _slowest(links, group, step)
    long = _slowest(links, group, prompt * act_bytes)
    n_reduce = 2 * n_layers
    decode = [n_reduce * link.all_reduce_s(step, n)]
    prefill = [n_reduce * long.all_reduce_s(prompt * act_bytes, n)]
    if whole:
        decode.append(link.all_reduce_s(step, n))
        prefill.append(long.all_reduce_s(prompt * act_bytes, n))
        logits = spec.vocab * act_bytes
        wide = _slowest(links, group, batch * logits)
        decode.append(wide.all_gather_s(batch * logits, n))
        prefill.append(_slowest(links, group, logits).all_gather_s(logits, n))
    return decode, prefill


def step_links(
    stages, links: list[LinkSpec], step: int, prompt: int, act_bytes: float
) -> tuple[list[float], list[float]]:
    """The leader's per-step command over all ranks, and (PP) each stage's hand-off of `step`
    (prefill: `prompt`) activations to the next, as (decode step, prefill) seconds; one
    collective per decode term."""
    decode, prefill = [], []
    everyone = tuple(n for s in stages for n in s.nodes)
    if len(everyone) > 1:
        # The leader's per-step command: one small all_sum around the ring of all ranks.
        ring = zip(everyone, everyone[1:] + everyone[:1], strict=True)
        hops = [_fastest(links, (a,), (b,), CONTROL_BYTES) for a, b in ring if a != b]
        control = max(hops, key=lambda x: x.all_reduce_s(CONTROL_BYTES, len(everyone)))
        decode.append(control.all_reduce_s(CONTROL_BYTES, len(everyone)))
    if len(stages) > 1:
        for k, stage in enumerate(stages):
            nxt = stages[(k + 1) % len(stages)]
            link = _fastest(links, stage.nodes, nxt.nodes, step * act_bytes)
            decode.append(link.hop_s(step * act_bytes))
            prefill.append(link.hop_s(prompt * act_bytes))
    return decode, prefill


def _slowest(links: list[LinkSpec], group: tuple[str, ...], nbytes: float) -> LinkSpec:
    """The slowest of the best links between every pair of a TP group."""
    pairs = [(a, b) for i, a in enumerate(group) for b in group[i + 1 :]]
    best = [_fastest(links, (a,), (b,), nbytes) for a, b in pairs]
    return max(best, key=lambda x: x.all_reduce_s(nbytes, len(group)))


def _fastest(
    links: list[LinkSpec], left: tuple[str, ...], right: tuple[str, ...], nbytes: float
) -> LinkSpec:
    """The quickest link for an nbytes message between any node of `left` and of `right`."""
    found = [x for a in left for b in right for x in link_between(links, a, b)]
    if not found:
        raise ThunderpoolError(
            f"no link between {', '.join(left)} and {', '.join(right)}; probe the links "
            "(`thunderpool status`) or plan without one of these nodes"
        )
    return min(found, key=lambda x: x.hop_s(nbytes))
