"""First-token seeding: the token prefill samples anyway goes to the client at once, and decode continues after it.

Prefill computes the prompt and samples one token from the same logits a colocated engine would. Streaming that token
straight away takes the KV hand-off off the path to the first token. Decode then continues from the second token:

- pull: decode's prompt is the prompt plus that token. The prompt's KV arrives by transfer (only the tokens prefill
  computed, see `remote_num_tokens`); decode computes the one seeded token itself, then samples the second.
- push: decode is dispatched before the token exists, so its prompt is the prompt alone and it samples the first
  token again. Under greedy sampling that is the same token, and the ingress drops decode's copy; under random
  sampling it could differ, so push seeds only greedy requests.

A request is seeded only where its output stays exactly what a colocated engine would give:
- presence and frequency penalties count output tokens only, and the seeded token would be a prompt token at decode;
- a seeded random sampler (`seed` with temperature > 0) would restart its random stream at decode;
- a stop string could span the seeded token and the next one, which decode alone cannot see;
- under pull, a structured output's grammar and multi-token bad words follow the output's tokens, and decode would
  take its first for the output's first (push decode samples the first token again, under its grammar, so greedy
  structured requests are seeded there).
Such requests take the unseeded path (prefill's token is dropped; decode samples the first token). Repetition
penalty, `min_tokens`, `max_tokens` and stop token ids carry over exactly. Logprobs need nothing of the kind: the
seeded token's come from prefill's logits, which are the colocated engine's.
"""

from __future__ import annotations

from vllm import SamplingParams

from kv.config import TransferMode


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature == 0


def can_seed(params: SamplingParams, mode: TransferMode) -> bool:
    """Whether this request's first token may come from prefill without changing its output."""
    if mode == "local":
        return False
    if params.presence_penalty or params.frequency_penalty or params.stop:
        return False
    if mode == "push":
        return is_greedy(params)
    if params.structured_outputs is not None or params.bad_words:
        return False
    return is_greedy(params) or params.seed is None


def prefill_sampling(params: SamplingParams, seeded: bool) -> SamplingParams:
    """Prefill samples one token: under the request's own rules when that token goes to the client, with its
    logprobs if they were asked for; unseeded, the token is dropped, and no grammar or logprobs are worked for it."""
    params = params.clone()
    params.max_tokens = 1
    params.min_tokens = min(params.min_tokens, 1) if seeded else 0
    if not seeded:
        params.logprobs = params.logprob_token_ids = params.structured_outputs = None
    return params


def after_seed(params: SamplingParams) -> SamplingParams:
    """Decode's sampling once the first token is already out: one token fewer of each budget."""
    params = params.clone()
    params.max_tokens = params.max_tokens - 1
    params.min_tokens = max(params.min_tokens - 1, 0)
    return params
