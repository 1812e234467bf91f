"""The engine's side of speculative decoding: after a step, which running requests draft and how
many drafts each keeps (`propose_drafts`); before a draft model's or head's step, how many drafts
each sampling row may use (`draft_lengths`). The proposals themselves are the proposer's
(`jaxserve.spec_decode`); the drafts a model computed reach it as `proposer.model_drafts`.
"""

from __future__ import annotations

from jaxserve.core.scheduler import SchedulerOutput


def propose_drafts(proposer, scheduler, runner, updated) -> None:
    """Draft tokens for each running request that just got tokens; forget finished ones.
    Opt-out: penalties that depend on the output history (their draft positions would need
    the drafts counted), what `Proposer.enabled_for` refuses, and drafts that would push the
    step into a larger token bucket unless the runner's measured step times say the expected
    accepted tokens pay for it (`Proposer.fit`). A constrained request's drafts end before
    the first token its grammar refuses."""
    batch_size = scheduler.num_running
    proposer.retain(scheduler.requests)      # aborted / stop-string finished
    proposals = {}
    for req in updated:
        if req.is_finished():
            proposer.finish(req.request_id, req.output_token_ids)
            continue
        if not may_draft(proposer, req, batch_size):
            continue
        drafts = proposer.propose(req.request_id, req.all_token_ids)
        if req.structured is not None:
            drafts = drafts[:req.structured.validate_tokens(drafts)]
        proposals[req] = drafts
    if not proposals:
        return
    n = min(batch_size, runner.buckets[-1])      # the next step's tokens, drafts aside
    fitted = proposer.fit({r.request_id: d for r, d in proposals.items()}, runner.bucket_for(n) - n,
                          cost=lambda extra: runner.step_cost(n + extra), tokens=n)
    for req in proposals:
        req.spec_token_ids = fitted[req.request_id]


def draft_lengths(proposer, scheduler, sched: SchedulerOutput) -> dict[str, int]:
    """Draft model or head: how many drafts each sampling row's request may use after this step
    (the proposer's opt-outs, judged now), so the drafter computes no drafts that would be
    dropped."""
    batch_size = scheduler.num_running
    out = {}
    for row in sched.scheduled:
        req = scheduler.get_request(row.request_id)
        if not row.sample or req is None:
            continue
        out[row.request_id] = proposer.draft_len(row.request_id) if may_draft(proposer, req, batch_size) else 0
    return out


def may_draft(proposer, req, batch_size: int) -> bool:
    """The opt-outs judged per request: penalties that depend on the output history (their
    draft positions would need the drafts counted) and what `Proposer.enabled_for` refuses."""
    sp = req.sampling_params
    return not (sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0
                ) and proposer.enabled_for(req.num_prompt_tokens, batch_size)
