"""One generation request and its host-side bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field

from reference_engine.sampling import SamplingParams


@dataclass
class RequestStats:
    """What the engine counts about a request as it runs (the GenerationOutput is made from it)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    preemptions: int = 0
    # time.perf_counter() seconds; the output reports the first token's and the finish's latency from
    # arrival. None until it happens, so a latency is never computed from a stamp that was not taken.
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    def since_arrival(self, stamp: float | None) -> float:
        return float("nan") if stamp is None else stamp - self.arrival_time


# eq=False: a request is itself, not the value of its fields. The scheduler asks ``request in
# running`` every pass; field-by-field equality made that a comparison of token lists.
@dataclass(eq=False)
class Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)  # async: confirmed tokens, then placeholders in flight
    num_confirmed: int = 0  # async: output tokens the host has seen (the rest are placeholders)
    num_computed: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)
    finished: bool = False
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """``len(tokens)``, without building the list (asked of every request every step)."""
        return len(self.prompt) + len(self.output)

    @property
    def prefill_target(self) -> int:
        """Tokens whose KV must exist before decoding: all but the last sampled one."""
        return self.num_tokens - 1 if self.output else len(self.prompt)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output)

    def stops_after(self, num_output: int, max_model_len: int) -> bool:
        """The stop rule, asked of the output's first ``num_output`` tokens: the last of them is the
        end of sequence (unless ignored), or they reach max_tokens, or prompt and output together
        reach the model's length. Both loops ask it token by token as outputs become known."""
        params = self.params
        token = self.output[num_output - 1]
        eos = params.eos_token_id is not None and token == params.eos_token_id and not params.ignore_eos
        return eos or num_output >= params.max_tokens or len(self.prompt) + num_output >= max_model_len
