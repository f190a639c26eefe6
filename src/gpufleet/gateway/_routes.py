"""The OpenAI surface the gateway proxies: every model route, by path, in one dict.

Each goes the same way as chat (``Gateway._proxy``): the body's ``model`` picks the pool, the
tenancy checks keys and quotas, the pool controller admits and routes it and rules on its
retries, the answer is metered into the usage ledger, the metrics are the model's. What
differs per route is only data, looked up once per request (chat pays nothing for the rest)::

    path                           must have (400)        usage in the ledger
    /v1/chat/completions           messages (a list)      prompt_tokens, completion_tokens
    /v1/completions                prompt                 (n choices: the engine sums them)
    /v1/responses                  input                  input_tokens, output_tokens
    /v1/embeddings                 input                  prompt_tokens
    /tokenize                      prompt or messages     none (no model runs): 0 tokens
    /detokenize                    tokens                 none: 0 tokens
    /v1/rerank /rerank /v2/rerank  —                      prompt_tokens, else total_tokens
    /v1/score /score               —                      prompt_tokens

Only chat and completions streams can be resumed on another replica (``_resume``); a
Responses API stream that breaks ends with that API's ``error`` event. A route the replica
does not serve (the sim engine has no rerank or score) is the replica's own 404, passed
through like any 4xx.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from gpufleet.gateway._errors import error_event, response_error_event
from gpufleet.gateway._usage import COMPLETIONS, INPUT_ONLY, NO_MODEL, RESPONSES, Metering


@dataclass(frozen=True, slots=True, eq=False)
class ProxyRoute:
    """What the gateway needs to know of one model route."""

    name: str
    needs: tuple[str, ...] = ()
    """The body must have one of these fields (else 400, as chat's ``messages``)."""
    chat: bool = False
    """Chat's body (``messages``: a non-empty list; the chat form of a resume)."""
    resumes: bool = False
    """A broken stream may be resumed on another replica (chat and completions)."""
    streams: bool = False
    """``"stream": true`` asks for server-sent events."""
    metering: Metering = COMPLETIONS
    broken: Callable[[str], bytes] = error_event
    """The events that end a stream broken after its first byte."""


CHAT: Final = ProxyRoute("chat", ("messages",), chat=True, resumes=True, streams=True)
COMPLETION: Final = ProxyRoute("completions", ("prompt",), resumes=True, streams=True)
RESPONSE: Final = ProxyRoute(
    "responses", ("input",), streams=True, metering=RESPONSES, broken=response_error_event
)
EMBEDDING: Final = ProxyRoute("embeddings", ("input",), metering=INPUT_ONLY)
TOKENIZE: Final = ProxyRoute("tokenize", ("prompt", "messages"), metering=NO_MODEL)
DETOKENIZE: Final = ProxyRoute("detokenize", ("tokens",), metering=NO_MODEL)
RERANK: Final = ProxyRoute("rerank", metering=INPUT_ONLY)
SCORE: Final = ProxyRoute("score", metering=INPUT_ONLY)

ROUTES: Final[dict[str, ProxyRoute]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/v1/responses": RESPONSE,
    "/v1/embeddings": EMBEDDING,
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
    "/v1/rerank": RERANK,
    "/rerank": RERANK,
    "/v2/rerank": RERANK,
    "/v1/score": SCORE,
    "/score": SCORE,
}
"""Every POST route the gateway proxies to a model's replicas (vLLM's paths)."""
