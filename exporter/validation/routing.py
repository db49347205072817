"""Router near ties of a mixture of experts: where a half-precision export departs from the fp32 reference at a
position (its prefill's last position, or a teacher-forced step), whether expert choices that the fp32 reference
makes by a near tie, taken the other way, give the export's logits there.

A token whose k-th and (k+1)-th router logits are closer than the dtype's near-tie margin (the bar a step's
top-1/top-2 gap is held to, gates.parity.NEAR_TIE_MARGIN) is routed by rounding: transformers' own half precision
flips such choices as the export does, and one flip can move the logits as far as a fault would (the tiny qwen3_5_moe
on the H100, benchmarks/results/h100/moe_routing_check_qwen3_5_moe_cuda.json: a bf16 export's choice at a 0.052 margin
moves the last logits 3.3 on a range of 14.7; transformers' fp32 with that one choice flipped gives the export's within
0.27). The replay shows it rather than assuming it: transformers' fp32 model runs again on the same inputs with such
a (layer, token)'s k-th expert replaced by its (k+1)-th, the experts weighted by the fp32 softmax as the router weights
them (renormalized where it renormalizes). A departure is a routing near tie where that run's logits at its position
choose the export's token and are within the dtype's tolerance of the export's and within half the distance of the
unflipped fp32 logits from the export's (the flips take fp32 most of the way). Candidates go smallest margin first, each
replayed on top of the flips that explained an earlier departure (a flip the export made moves every later position:
a later departure may need it and one more), a flip kept only where it explains a departure; once one is kept, the
candidates are the near ties of the run with it (a flip moves the router logits of the tokens after it); at most
MAX_REPLAYS forward passes.

Routers are transformers' top-k router modules (``...mlp.gate`` with ``top_k``, giving router logits, the chosen
experts' weights and their ids: qwen3_5_moe, qwen3_vl_moe, qwen3_moe, mixtral and most others); a router whose weights
are not its softmax's (sigmoid or biased routing) is not replayed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MAX_REPLAYS = 16


@dataclasses.dataclass
class Flip:
    """One expert choice taken the other way: router ``layer``'s k-th expert at ``token`` replaced by its (k+1)-th."""

    layer: int  # the router, in layer order
    token: int  # the position
    margin: float  # the fp32 router's k-th minus (k+1)-th logit there
    experts: list[int]  # the fp32 choice
    flipped: list[int]  # the replay's



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
    """A RoutingTie (as its report dict) in a clause: "router near ties (layer 0's experts at token 7, [1, 3] in fp32
    by 0.0524, as [0, 1]): transformers' fp32 with them flipped gives the export's logits within 0.273, where unflipped
    they are 3.32 away (tolerance 2.94)"."""
    flips = "; ".join(f"layer {f['layer']}'s experts at token {f['token']}, {f['experts']} in fp32 by {f['margin']:.3g}, "
                      f"as {f['flipped']}" for f in tie["flips"])
    return (f"router near ties ({flips}): transformers' fp32 with them flipped gives the export's logits within "
            f"{tie['replay_error']:.3g}, where unflipped they are {tie['departure']:.3g} away (tolerance "
            f"{tie['tolerance']:.3g})")


def routers(model) -> list:
    """transformers' top-k routers of ``model`` (``mlp.gate`` modules with ``top_k``), in layer order; ``model`` may be
    the streamed reference (streamed.StreamedReference: its transformers model's)."""
    root = model if hasattr(model, "named_modules") else model.model
    return [m for name, m in root.named_modules() if name.endswith("mlp.gate") and hasattr(m, "top_k")]


def _weights(logits, chosen, renormalize: bool):
    import torch

    kept = torch.softmax(logits.float(), -1).gather(1, chosen)
    return kept / kept.sum(-1, keepdim=True) if renormalize else kept


def router_logits(model, inputs: dict, flips: list[tuple[int, int, int]] = (),
                  renormalize: list[bool] | None = None) -> tuple[np.ndarray, list[tuple[np.ndarray, bool]]] | None:
    """One pass of ``model`` (with ``flips``, as ``replay``): (its logits [positions, vocab], each router's logits
    [tokens, experts] (fp32) and whether it renormalizes its top-k weights); None where the model has no router, or one
    whose weights are not its softmax's (not replayed)."""
    import torch

    found = routers(model)
    if not found:
        return None
    seen: list = []
    if flips:
        def record(_, __, out):
            seen.append((out[0].detach().float().cpu().numpy(), renormalize[len(seen)]))

        hooks = [router.register_forward_hook(record) for router in found]
        try:
            logits = replay(model, inputs, flips, renormalize)
        finally:
            for hook in hooks:
                hook.remove()
        return logits, seen

    def record(_, __, out):
        logits, scores, chosen = out
        kinds = [renormalize for renormalize in (True, False)
                 if torch.allclose(scores.float(), _weights(logits, chosen, renormalize), atol=1e-4)]
        seen.append((logits.detach().float().cpu().numpy(), kinds[0] if kinds else None))

    hooks = [router.register_forward_hook(record) for router in found]
    try:
        with torch.no_grad():
            logits = model(**inputs).logits[0].float().cpu().numpy()
    finally:
        for hook in hooks:
            hook.remove()
    return None if any(kind is None for _, kind in seen) else (logits, seen)


def replay(model, inputs: dict, flips: list[tuple[int, int, int]], renormalize: list[bool]) -> np.ndarray:
    """``model``'s logits [positions, vocab] on ``inputs`` with each (layer, token, expert) of ``flips``: that
    router's k-th expert at that token replaced by ``expert`` (``renormalize``: per router, as routing.router_logits
    found it)."""
    import torch

    found = routers(model)
    patched = []
    for layer in sorted({layer for layer, _, _ in flips}):
        router, plain = found[layer], found[layer].forward
        mine = [(token, expert) for at, token, expert in flips if at == layer]

        def forward(hidden, router=router, plain=plain, mine=mine, renormalize=renormalize[layer]):
            logits, scores, chosen = plain(hidden)
            chosen = chosen.clone()
            for token, expert in mine:
                chosen[token, router.top_k - 1] = expert
            return logits, _weights(logits, chosen, renormalize).to(scores.dtype), chosen

        router.forward = forward
        patched.append((router, plain))
    try:
        with torch.no_grad():
            return model(**inputs).logits[0].float().cpu().numpy()
    finally:
        for router, plain in patched:
            router.forward = plain


def explain(model, inputs: dict, first: int, departures: dict[int, np.ndarray], tie_margin: float,
            tolerance: float) -> dict[int, RoutingTie]:
    """Which ``departures`` (step -> the export's logits there; step i sits at position ``first`` + i of ``inputs``'
    tokens) flipped near-tie expert choices of the fp32 ``model`` explain: {step: RoutingTie}. ``tie_margin``: the
    largest router margin that counts as a near tie; ``tolerance``: the max abs logit error a replay may leave."""
    passed = router_logits(model, inputs) if departures else None
    if passed is None:
        return {}
    plain, seen = passed
    last = first + max(departures)
    renormalize = [kind for _, kind in seen]
    k = [router.top_k for router in routers(model)]

    def near_ties(seen: list, done: list[Flip]) -> list[Flip]:
        """The near-tie choices of a run whose router logits are ``seen``, smallest margin first, but ``done``'s."""
        taken = {(f.layer, f.token) for f in done}
        ties = []
        for layer, (logits, _) in enumerate(seen):
            order = np.argsort(-logits, axis=-1, kind="stable")
            ranked = np.take_along_axis(logits, order, axis=-1)
            top = k[layer]
            for token in range(min(len(logits), last + 1)):
                margin = float(ranked[token, top - 1] - ranked[token, top])
                if margin < tie_margin and (layer, token) not in taken:
                    ties.append(Flip(layer, token, round(margin, 4), sorted(int(e) for e in order[token, :top]),
                                     sorted(int(e) for e in [*order[token, :top - 1], order[token, top]])))
        return sorted(ties, key=lambda f: f.margin)

    def flips(chosen: list[Flip]) -> list[tuple[int, int, int]]:
        return [(f.layer, f.token, (set(f.flipped) - set(f.experts)).pop()) for f in chosen]

    kept: list[Flip] = []
    found: dict[int, RoutingTie] = {}
    pool = near_ties(seen, kept)
    for _ in range(MAX_REPLAYS):
        if not pool or len(found) == len(departures):
            break
        flip = pool.pop(0)
        trial = kept + [flip]
        logits, seen = router_logits(model, inputs, flips(trial), renormalize)
        for step, export in departures.items():
            position = first + step
            if step in found or flip.token > position:
                continue
            error = float(np.abs(logits[position] - export).max())
            departure = float(np.abs(plain[position] - export).max())
            if error <= min(tolerance, departure / 2) and int(np.argmax(logits[position])) == int(np.argmax(export)):
                found[step] = RoutingTie(step, [f for f in trial if f.token <= position], error, departure, tolerance)
        if any(tie.flips[-1] is flip for tie in found.values()):
            kept = trial
            pool = near_ties(seen, kept)  # the choices as the run with the kept flips makes them
    return found


def explain_run(model, inputs: dict, run, ref, dtype: str) -> dict[int, RoutingTie]:
    """The departures of an export's teacher-forced ``run`` (parity.ExportRun) from ``ref`` (reference.ReferenceRun)
    that flipped near-tie expert choices of transformers' fp32 ``model`` explain: its prefill beyond the dtype's
    tolerance (step 0) and its differing steps where the reference is decisive. ``inputs``: ``model``'s inputs for the
    prompt and the reference's tokens in one pass. {} for a model without top-k routers, and where the replay cannot
    run (logged: it explains, it is not a gate)."""
    import logging

    from exporter import checkpoints
    from exporter.validation.gates.parity import NEAR_TIE_MARGIN, PREFILL_TOLERANCE
    from exporter.validation.parity import judge

    result = judge(run, ref, NEAR_TIE_MARGIN[dtype])
    tolerance = PREFILL_TOLERANCE[dtype] * result.logit_range
    departures = {step: run.logits[step] for step in result.mismatches}
    if result.prefill_max_abs_error > tolerance:
        departures[0] = run.logits[0]
    if not departures or not routers(model):
        return {}
    try:
        return explain(model, inputs, len(ref.prompt) - 1, departures, NEAR_TIE_MARGIN[dtype], tolerance)
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
    return ["", "Router near ties (departures from fp32 that flipped near-tie expert choices explain, replayed on "
            "transformers' fp32 model; not failures):", ""] + [
        f"- {prompt}, {'prefill' if tie['step'] == 0 else 'step ' + str(tie['step'])}: {describe(tie)}"
        for prompt, tie in ties]
