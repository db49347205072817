"""Router near ties of a mixture of experts: where a half-precision export departs from the fp32 reference at a
position (its prefill's last position, or a teacher-forced step), whether expert choices that the fp32 reference
makes by a near tie, taken the other way, give the export's logits there.

A token whose k-th and (k+1)-th router logits are closer than the dtype's near-tie margin (the bar a step's
top-1/top-2 gap is held to, gates.parity.NEAR_TIE_MARGIN) is routed by rounding, and one such choice taken the other
way can move the logits as far as a fault would: the tiny qwen3_5_moe's bf16 export on the H100 picks the other expert
at a 0.052 margin and its last logits move 3.3 on a range of 14.7; transformers' fp32 forced to the export's choices
(read from the export's own router logits, benchmarks/moe_routing_check.py) gives the export's within 0.27
(benchmarks/results/h100/moe_routing_check_qwen3_5_moe_cuda.json; transformers' own bf16 kept that choice, and flips
others). Validation cannot read the export's choices (the decoder has no router output), so it replays candidates:
transformers' fp32 model runs again on the same inputs with near-tie choices taken the other way (the k-th expert
replaced by the (k+1)-th, weighted by the fp32 softmax as the router weights them, renormalized where it
renormalizes), smallest margin first, each on top of the flips kept so far (a flip moves every later position: a
later departure may need it and one more); a flip is kept where it explains a departure, and the candidates are then
the near ties of the run with the kept flips. A departure is explained where a replay chooses the export's token there
(or the reference's gap there is a near tie) and its logits are within the dtype's tolerance of the export's and
nearer than half the unflipped fp32's distance. A trial is kept only where it explains a departure, still explains the
ones explained before, keeps each kept flip a near tie between the same two experts in its own run (an earlier flip
moves the router logits after it), and leaves the export no worse off than plain fp32 at every other step it reaches
(its logits within the tolerance or nearer the export's than fp32's, the export's token wherever fp32 chose it). What
this shows: choices that rounding may take either way reproduce the export's logits; not that the export took them.
At most MAX_REPLAYS + 1 forward passes.

Routers are transformers' top-k router modules (``...mlp.gate`` with ``top_k``, giving router logits, the chosen
experts' weights and their ids: qwen3_5_moe, qwen3_vl_moe, qwen3_moe, mixtral and others). One whose chosen experts are
not the top k of its logits (grouped or biased routing) or whose weights are not its softmax's is not replayed.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from exporter import checkpoints

MAX_REPLAYS = 16
# Attributes of routers that choose by something besides their logits' top k (a bias, groups, statics): not replayed
# whatever one input shows (deepseek_v3 / glm4_moe's e_score_correction_bias and n_group, ernie4_5_moe's moe_statics).
BIASED_ROUTER_ATTRIBUTES = ("e_score_correction_bias", "n_group", "moe_statics", "expert_bias")


@dataclasses.dataclass
class Flip:
    """One expert choice taken the other way: the router of decoder layer ``layer`` at ``token`` runs ``flipped``
    instead of ``experts`` (its k-th expert replaced by its (k+1)-th)."""

    layer: int  # the decoder layer
    router: int  # the router's index among the model's routers
    token: int  # the position
    margin: float  # the router's k-th minus (k+1)-th logit there, in the run it was found in
    experts: list[int]  # that run's choice
    flipped: list[int]  # the replay's

    @property
    def swap(self) -> tuple[int, int]:
        """(the expert taken out, the expert put in)."""
        return (set(self.experts) - set(self.flipped)).pop(), (set(self.flipped) - set(self.experts)).pop()


@dataclasses.dataclass
class RoutingTie:
    """A departure at ``step`` that flipped near-tie expert choices explain."""

    step: int  # 0: the prefill's last position; i: the logits that choose the i-th reference token
    flips: list[Flip]
    replay_error: float  # max abs, the replay's logits against the export's at the step's position
    departure: float  # max abs, the unflipped fp32 logits against the export's there
    tolerance: float

    def describe(self) -> str:
        return describe(self.to_dict())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def describe(tie: dict) -> str:
    """A RoutingTie (as its report dict) in a clause: "router near ties (decoder layer 0's experts at token 7, [1, 3]
    by a margin of 0.0524, as [0, 1]): transformers' fp32 with them flipped gives the export's logits within 0.273,
    where unflipped they are 3.32 away (tolerance 2.94)"."""
    flips = "; ".join(f"decoder layer {f['layer']}'s experts at token {f['token']}, {f['experts']} by a margin of "
                      f"{f['margin']:.3g}, as {f['flipped']}" for f in tie["flips"])
    return (f"router near ties ({flips}): transformers' fp32 with them flipped gives the export's logits within "
            f"{tie['replay_error']:.3g}, where unflipped they are {tie['departure']:.3g} away (tolerance "
            f"{tie['tolerance']:.3g})")


def routers(model) -> list[tuple[int, object]]:
    """transformers' top-k routers of ``model`` (``mlp.gate`` modules with ``top_k``) with their decoder layers, in
    layer order; ``model`` may be the streamed reference (streamed.StreamedReference: its transformers model's)."""
    root = model if hasattr(model, "named_modules") else model.model
    found = []
    for name, module in root.named_modules():
        if name.endswith("mlp.gate") and hasattr(module, "top_k"):
            layer = re.search(r"layers\.(\d+)\.", name)  # (a name without one: its index among the routers)
            found.append((int(layer.group(1)) if layer else len(found), module))
    return found


def departures(run, ref, dtype: str, gap_margin: float | None = None) -> dict[int, np.ndarray]:
    """Where an export's teacher-forced ``run`` (parity.ExportRun) departs from ``ref`` (reference.ReferenceRun) as the
    parity gates judge it: step -> the export's logits there, for its prefill beyond the dtype's tolerance (step 0) and
    each step whose token differs where the reference's top-1/top-2 gap is not a near tie (below ``gap_margin``: the
    gates' margin, by default the dtype's fixed one)."""
    from exporter.validation.gates.parity import NEAR_TIE_MARGIN, PREFILL_TOLERANCE
    from exporter.validation.parity import judge

    result = judge(run, ref, NEAR_TIE_MARGIN[dtype] if gap_margin is None else gap_margin)
    found = {step: run.logits[step] for step in result.mismatches}
    if result.prefill_max_abs_error > PREFILL_TOLERANCE[dtype] * result.logit_range:
        found[0] = run.logits[0]
    return found


def _weights(logits, chosen, renormalize: bool):
    import torch

    kept = torch.softmax(logits.float(), -1).gather(1, chosen)
    return kept / kept.sum(-1, keepdim=True) if renormalize else kept


def _replayable(logits, scores, chosen) -> bool | None:
    """Whether a router's output renormalizes its top-k weights (True / False), None where it cannot be replayed: its
    chosen experts are not its logits' top k, or its weights are not its softmax's."""
    import torch

    k = chosen.shape[-1]
    if scores.shape != chosen.shape or logits.ndim != 2:
        return None
    top = torch.topk(logits.float(), k, dim=-1).indices
    if not torch.equal(torch.sort(chosen, -1).values, torch.sort(top, -1).values):
        return None
    for renormalize in (True, False):
        if torch.allclose(scores.float(), _weights(logits, chosen, renormalize), atol=1e-4):
            return renormalize
    return None


def hooked_pass(model, inputs: dict, record) -> np.ndarray:
    """One pass of ``model`` on ``inputs`` with ``record(router, its output)`` called by every top-k router, in layer
    order: the model's logits [positions, vocab], fp32 on the host."""
    import torch

    hooks = [router.register_forward_hook(lambda module, _, out: record(module, out)) for _, router in routers(model)]
    try:
        with torch.no_grad():
            return model(**inputs).logits[0].float().cpu().numpy()
    finally:
        for hook in hooks:
            hook.remove()


def router_logits(model, inputs: dict) -> tuple[np.ndarray, list[np.ndarray], list[bool]] | None:
    """One pass of ``model``: (its logits [positions, vocab], each router's logits [tokens, experts] in fp32, whether
    each renormalizes its top-k weights); None where the model has no router or one that cannot be replayed."""
    found = routers(model)
    if not found or any(hasattr(router, a) for _, router in found for a in BIASED_ROUTER_ATTRIBUTES):
        return None
    seen: list = []

    def record(router, out):
        logits, scores, chosen = out
        seen.append((logits.detach().float().cpu().numpy(), _replayable(logits, scores, chosen)))

    logits = hooked_pass(model, inputs, record)
    if len(seen) != len(found) or any(kind is None for _, kind in seen):
        return None
    return logits, [lg for lg, _ in seen], [kind for _, kind in seen]


def replay(model, inputs: dict, flips: list[Flip], renormalize: list[bool]) -> tuple[np.ndarray, list[np.ndarray]]:
    """``model`` on ``inputs`` with ``flips`` taken (``renormalize``: per router, as router_logits found it): (its
    logits [positions, vocab], each router's logits [tokens, experts]). A flip whose expert is not chosen there, or
    whose replacement already is, raises ValueError."""
    found = routers(model)
    seen: list = []
    patched = []
    try:
        for index, (_, router) in enumerate(found):
            mine = [f for f in flips if f.router == index]
            if not mine:
                continue
            plain = router.forward

            def forward(hidden, plain=plain, mine=mine, renormalize=renormalize[index]):
                logits, scores, chosen = plain(hidden)
                chosen = chosen.clone()
                for flip in mine:
                    out, into = flip.swap
                    row = chosen[flip.token]
                    column = (row == out).nonzero()
                    if len(column) != 1 or bool((row == into).any()):
                        raise ValueError(f"router {flip.router} at token {flip.token} does not choose {out} alone")
                    chosen[flip.token, int(column[0, 0])] = into
                return logits, _weights(logits, chosen, renormalize).to(scores.dtype), chosen

            patched.append(router)
            router.forward = forward  # an instance attribute, removed below (no reference cycle left behind)
        logits = hooked_pass(model, inputs, lambda _, out: seen.append(out[0].detach().float().cpu().numpy()))
    finally:
        for router in patched:
            vars(router).pop("forward", None)
    return logits, seen


def near_ties(model, seen: list[np.ndarray], last: int, tie_margin: float, done: list[Flip] = ()) -> list[Flip]:
    """The choices of a run whose router logits are ``seen`` at tokens up to ``last`` whose k-th and (k+1)-th logits
    are closer than ``tie_margin``, as flips, smallest margin first; not at a (router, token) ``done`` flips."""
    found = routers(model)
    taken = {(f.router, f.token) for f in done}
    ties = []
    for index, ((layer, router), logits) in enumerate(zip(found, seen)):
        k = router.top_k
        order = np.argsort(-logits, axis=-1, kind="stable")
        ranked = np.take_along_axis(logits, order, axis=-1)
        for token in range(min(len(logits), last + 1)):
            margin = float(ranked[token, k - 1] - ranked[token, k])
            if margin < tie_margin and (index, token) not in taken:
                ties.append(Flip(layer, index, token, round(margin, 4), sorted(int(e) for e in order[token, :k]),
                                 sorted(int(e) for e in [*order[token, :k - 1], order[token, k]])))
    return sorted(ties, key=lambda f: f.margin)


def _holding(flips: list[Flip], seen: list[np.ndarray], tie_margin: float) -> list[Flip] | None:
    """``flips`` as the run whose router logits are ``seen`` makes them (their margins that run's), None where one is no
    longer that run's near tie between the same two experts (an earlier flip moved it)."""
    held = []
    for flip in flips:
        logits = seen[flip.router][flip.token]
        k = len(flip.experts)
        order = np.argsort(-logits, kind="stable")
        margin = float(logits[order[k - 1]] - logits[order[k]])
        if sorted(int(e) for e in order[:k]) != flip.experts or int(order[k]) != flip.swap[1] or not margin < tie_margin:
            return None
        held.append(dataclasses.replace(flip, margin=round(margin, 4)))
    return held


def explain(model, inputs: dict, first: int, export: list[np.ndarray], ref, steps: list[int], tie_margin: float,
            tolerance: float, gap_margin: float | None = None) -> dict[int, RoutingTie]:
    """Which departed ``steps`` flipped near-tie expert choices of the fp32 ``model`` explain: {step: RoutingTie}.
    ``export``: the export's logits at every step of ``ref`` (reference.ReferenceRun), step i at position ``first`` + i
    of ``inputs``' tokens; ``tie_margin``: the largest router margin that counts as a near tie; ``gap_margin``: the
    reference's top-1/top-2 gap below which a step's token is a near tie (default ``tie_margin``); ``tolerance``: the
    largest max abs logit error a replay may leave.

    A trial (the kept flips and one more) is kept where it explains a departure not explained yet, still explains
    those explained before, keeps each kept flip a near tie of its run, and leaves the export no worse off than plain
    fp32 at every other step it reaches (its logits within the tolerance or nearer the export's than fp32's; the
    export's token wherever fp32 chose it); departures no trial explains are not held to anything."""
    passed = router_logits(model, inputs) if steps else None
    if passed is None:
        return {}
    plain, seen, renormalize = passed
    gap_margin = tie_margin if gap_margin is None else gap_margin

    def error(logits: np.ndarray, step: int) -> float:
        return float(np.abs(logits[first + step] - export[step]).max())

    def token(logits: np.ndarray, step: int) -> int:
        return int(np.argmax(logits[first + step]))

    def explains(logits: np.ndarray, step: int) -> bool:
        chosen = token(logits, step) == int(np.argmax(export[step])) or ref.gaps[step] < gap_margin
        return chosen and error(logits, step) <= tolerance and error(logits, step) < error(plain, step) / 2

    def no_worse(logits: np.ndarray, step: int) -> bool:
        if not error(logits, step) <= max(tolerance, error(plain, step)):  # (a NaN is worse)
            return False
        export_token = int(np.argmax(export[step]))
        return token(logits, step) == export_token or token(plain, step) != export_token or ref.gaps[step] < gap_margin

    kept: list[Flip] = []
    explained: set[int] = set()
    best = None  # the last kept trial's logits
    pool = near_ties(model, seen, first + max(steps), tie_margin)
    for _ in range(MAX_REPLAYS):
        left = [step for step in steps if step not in explained]
        pool = [f for f in pool if f.token <= first + max(left)] if left else []
        if not pool:
            break
        checkpoints.checkpoint()
        flip = pool.pop(0)
        try:
            logits, trial_seen = replay(model, inputs, kept + [flip], renormalize)
        except ValueError:
            continue
        held = _holding(kept + [flip], trial_seen, tie_margin)
        newly = {step for step in left if flip.token <= first + step and explains(logits, step)}
        if held is None or not newly or not all(explains(logits, step) for step in explained):
            continue
        start = max(0, min(f.token for f in held) - first)
        if not all(no_worse(logits, step) for step in range(start, len(export)) if step not in steps):
            continue
        kept, best = held, logits
        explained |= newly
        pool = near_ties(model, trial_seen, first + max(steps), tie_margin, kept)  # the choices as that run makes them
    return {step: RoutingTie(step, [f for f in kept if f.token <= first + step], error(best, step), error(plain, step),
                             tolerance) for step in sorted(explained)}


def explain_run(model, inputs: dict, run, ref, dtype: str, gap_margin: float | None = None) -> dict[int, RoutingTie]:
    """The departures of an export's teacher-forced ``run`` (parity.ExportRun) from ``ref`` (reference.ReferenceRun)
    that flipped near-tie expert choices of transformers' fp32 ``model`` explain (``departures``, ``explain``).
    ``inputs``: ``model``'s inputs for the prompt and the reference's tokens in one pass; ``gap_margin``: the near-tie
    margin the parity gates judge tokens by (a sound yardstick's measured one; default the dtype's fixed one). {} for a
    model without replayable routers, and where the replay cannot run (logged: it explains, it is not a gate)."""
    import logging

    from exporter.validation.gates.parity import NEAR_TIE_MARGIN, PREFILL_TOLERANCE

    found = departures(run, ref, dtype, gap_margin)
    if not found or not routers(model):
        return {}
    span = float(ref.prefill_logits.max() - ref.prefill_logits.min())
    try:
        return explain(model, inputs, len(ref.prompt) - 1, run.logits[: len(ref.tokens)], ref, sorted(found),
                       NEAR_TIE_MARGIN[dtype], PREFILL_TOLERANCE[dtype] * span, gap_margin)
    except Exception as err:
        if checkpoints.is_stop(err):
            raise  # a cancel or a lost lease, not a failure of this step
        logging.getLogger(__name__).warning("the routing replay could not run: %s", err)
        return {}


def render_ties(runs: list[tuple[str, dict]]) -> list[str]:
    """The report's markdown lines for the router near ties of (prompt, parity result dict) ``runs``; none without."""
    ties = [(prompt, tie) for prompt, run in runs for tie in run.get("routing_ties") or ()]
    if not ties:
        return []
    return ["", "Router near ties (departures from fp32 that near-tie expert choices taken the other way reproduce, "
            "replayed on transformers' fp32 model; not failures):", ""] + [
        f"- {prompt}, {'prefill' if tie['step'] == 0 else 'step ' + str(tie['step'])}: {describe(tie)}"
        for prompt, tie in ties]
