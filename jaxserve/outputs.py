"""What generation returns: `RequestOutput` holding one `CompletionOutput` per sample (vLLM's shapes).

Host side, no jax. `Logprob` entries map token id -> Logprob for the sampled token and the top-k;
`SampleLogprobs` is one such dict per generated token, `PromptLogprobs` one per prompt token
(None for the first, which has no context).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log probability of one token, its rank in the vocabulary (1 = most likely) and its
    decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample of a request.

    finish_reason: None while running, else "stop", "length", "abort" or "error" (its step failed).
    stop_reason: the stop string or stop token id that ended it; None for EOS, length or running.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, "
                f"token_ids={self.token_ids}, cumulative_logprob={self.cumulative_logprob}, "
                f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
                f"stop_reason={self.stop_reason})")


@dataclass
class RequestMetrics:
    """Timestamps (time.time() seconds) of one request's life."""

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    # Not in vLLM's RequestMetrics: every gap between consecutive output tokens (seconds), so
    # the inter-token latency histogram sees each gap, not a per-request mean.
    inter_token_latencies: list[float] = field(default_factory=list, repr=False)


class RequestOutput:
    """The output of one request so far (or the delta since the last one, in DELTA mode).

    prompt_logprobs: one entry per prompt position, the first None (vLLM's layout); in DELTA mode
    only the positions computed since the previous output (a prompt prefilled in several chunks
    arrives in several pieces, each position once), None when there are none. Every output owns
    its list: the engine never changes it after handing it over.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 prompt_logprobs: PromptLogprobs | None, outputs: list[CompletionOutput],
                 finished: bool, metrics: RequestMetrics | None = None,
                 num_cached_tokens: int = 0) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.num_cached_tokens = num_cached_tokens

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one.

        aggregate=True appends deltas (text, tokens, logprobs) to the matching completion, which is
        how a DELTA stream is coalesced; aggregate=False replaces each completion wholesale.
        """
        self.finished |= next_output.finished
        self.metrics = next_output.metrics or self.metrics
        self.num_cached_tokens = next_output.num_cached_tokens
        if next_output.prompt_logprobs is not None:
            # DELTA outputs carry the prompt positions computed since the last one (a long
            # prompt's prefill chunks arrive in several); a cumulative one carries them all.
            if aggregate and self.prompt_logprobs is not None:
                self.prompt_logprobs = list(self.prompt_logprobs) + list(next_output.prompt_logprobs)
            else:
                self.prompt_logprobs = next_output.prompt_logprobs
        for nxt in next_output.outputs:
            for i, cur in enumerate(self.outputs):
                if cur.index != nxt.index:
                    continue
                if aggregate:
                    cur.text += nxt.text
                    cur.token_ids = list(cur.token_ids) + list(nxt.token_ids)
                    if nxt.logprobs is not None:
                        cur.logprobs = (cur.logprobs or []) + nxt.logprobs
                    cur.cumulative_logprob = nxt.cumulative_logprob
                    cur.finish_reason = nxt.finish_reason
                    cur.stop_reason = nxt.stop_reason
                else:
                    self.outputs[i] = nxt
                break
            else:
                self.outputs.append(nxt)
        self.outputs.sort(key=lambda c: c.index)

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, "
                f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
                f"finished={self.finished}, metrics={self.metrics}, "
                f"num_cached_tokens={self.num_cached_tokens})")


class PoolingOutput:
    """The pooled vector of one prompt (vLLM's `PoolingOutput`; `data` is a numpy float32
    array [dimensions] here, a torch tensor there)."""

    def __init__(self, data):
        self.data = data

    def __repr__(self) -> str:
        return f"PoolingOutput(data={self.data!r})"


class PoolingRequestOutput:
    """The output of one pooling request (vLLM's shape). `outputs` is None when the request
    did not finish with a vector: `finish_reason` is then "abort" or "error" (its step failed);
    "stop" otherwise."""

    def __init__(self, request_id: str, outputs: PoolingOutput | None, prompt_token_ids: list[int],
                 finished: bool = True, num_cached_tokens: int = 0, prompt: str | None = None,
                 finish_reason: str = "stop", metrics: RequestMetrics | None = None) -> None:
        self.request_id = request_id
        self.outputs = outputs
        self.prompt_token_ids = prompt_token_ids
        self.finished = finished
        self.num_cached_tokens = num_cached_tokens
        self.prompt = prompt
        self.finish_reason = finish_reason
        self.metrics = metrics

    def add(self, next_output: PoolingRequestOutput, aggregate: bool) -> None:
        """A pooling request has one output; a later one replaces it (AsyncLLM's slot)."""
        self.__dict__.update(next_output.__dict__)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(request_id={self.request_id!r}, outputs={self.outputs!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, finished={self.finished}, "
                f"finish_reason={self.finish_reason!r})")


class EmbeddingOutput:
    """One embedding (vLLM's `EmbeddingOutput`): `embedding` is a list of floats."""

    def __init__(self, embedding: list[float]):
        self.embedding = embedding

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        return cls([float(x) for x in output.data])

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"


class EmbeddingRequestOutput(PoolingRequestOutput):
    """`LLM.embed`'s result per prompt: `.outputs.embedding` (vLLM's shape)."""

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, None if out.outputs is None else EmbeddingOutput.from_base(out.outputs),
                   out.prompt_token_ids, out.finished, out.num_cached_tokens, out.prompt,
                   out.finish_reason, out.metrics)
