"""Logprobs in the OpenAI JSON layouts, built from jaxserve's vLLM-style
`[{token_id: Logprob(logprob, rank, decoded_token)}]` lists."""

from __future__ import annotations


def _lp(value: float) -> float:
    return max(value, -9999.0)


def completion_logprobs(tok, token_ids: list[int], steps: list, initial_offset: int) -> dict:
    """OpenAI completions logprobs: {tokens, token_logprobs, top_logprobs, text_offset}.
    steps[i] is the {token id: Logprob} dict of token i, or None (the first prompt token)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = initial_offset
    for tid, step in zip(token_ids, steps):
        if step is None or tid not in step:
            text = tok.decode_token(tid)
            token_lps.append(None)
            tops.append(None)
        else:
            entry = step[tid]
            text = entry.decoded_token if entry.decoded_token is not None \
                else tok.decode_token(tid)
            token_lps.append(_lp(entry.logprob))
            tops.append({(e.decoded_token if e.decoded_token is not None
                          else tok.decode_token(t)): _lp(e.logprob) for t, e in step.items()})
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tok, token_ids: list[int], steps: list, top: int) -> dict:
    """OpenAI chat logprobs: {content: [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def item(t: int, e) -> dict:
        text = e.decoded_token if e.decoded_token is not None else tok.decode_token(t)
        return {"token": text, "logprob": _lp(e.logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for tid, step in zip(token_ids, steps):
        if step is None or tid not in step:
            continue
        ranked = sorted(((t, e) for t, e in step.items() if e.rank is not None),
                        key=lambda te: te[1].rank)
        content.append({**item(tid, step[tid]),
                        "top_logprobs": [item(t, e) for t, e in ranked[:top]]})
    return {"content": content}


def prompt_logprobs_json(prompt_logprobs) -> list | None:
    if prompt_logprobs is None:
        return None
    return [None if step is None else
            {str(t): {"logprob": _lp(e.logprob), "rank": e.rank,
                      "decoded_token": e.decoded_token} for t, e in step.items()}
            for step in prompt_logprobs]
