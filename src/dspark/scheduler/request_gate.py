"""Which requests of a plain step draft anyway: the request-level half of the asynchronous scheduler's draft gate.

Acceptance belongs to the requests: in one batch a GSM8K answer commits three tokens per drafting step while a chat
answer commits 1.3. Where drafting every request costs more than it brings, drafting the few whose own past
acceptance is high can still pay (docs/serving/step-cost.md §Drafting some requests). A step in which R_d of R
requests draft is priced as the measured plain step plus R_d times the measured cost of one more drafting request;
requests are admitted by their own acceptance, best first, while each raises the step's tokens per second.

Lossless like the rest of the gate: a request's choice reads its past steps and the past timings, never this
step's drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

#: a request's own drafting steps before its mean acceptance stands for it (one step commits 1 to 1 + K tokens)
MIN_OWN_STEPS = 2


def own_acceptance(drafted_steps: int, drafted_tokens: float) -> float | None:
    """A request's mean tokens committed per drafting step (``RequestState.drafted_steps`` / ``drafted_tokens``),
    or None below ``MIN_OWN_STEPS`` steps."""
    return drafted_tokens / drafted_steps if drafted_steps >= MIN_OWN_STEPS else None


def drafting_subset(
    acceptance: Sequence[float | None],  # (R,) each request's own mean tokens per drafting step, None = unknown
    plain_s: float,  # seconds of a plain step of these R requests
    marginal_s: float,  # seconds one more drafting request adds to a step
) -> list[bool]:  # (R,) whether each request drafts
    """The requests whose drafting raises the step's expected tokens per second, admitted best first.

    A plain step makes R tokens in ``plain_s``; admitting request r adds tau_r - 1 expected tokens and
    ``marginal_s``: it pays while (tau_r - 1) / marginal_s exceeds the tokens per second of the step so far.
    Unknown requests are left out here (``AsyncTopKScheduler.drafting_requests`` lets them draft until they have a
    record).
    """
    R = len(acceptance)
    if R == 0 or plain_s <= 0 or marginal_s <= 0:
        return [False] * R
    order = sorted((r for r in range(R) if acceptance[r] is not None), key=lambda r: (-acceptance[r], r))
    tokens, seconds, chosen = float(R), plain_s, [False] * R
    for r in order:
        gain = acceptance[r] - 1.0
        if gain * seconds <= tokens * marginal_s:  # gain / marginal_s <= tokens / seconds: no longer raises the rate
            break
        chosen[r] = True
        tokens, seconds = tokens + gain, seconds + marginal_s
    return chosen
