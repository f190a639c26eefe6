"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them (no ``/v1`` prefix).

    POST /tokenize   {"prompt": "Hi there"}                        a completion prompt
    POST /tokenize   {"messages": [{"role": "user", "content": "Hi"}]}   the chat template's
    → {"count": 3, "max_model_len": 4096, "tokens": [...], "token_strs": null}
    POST /detokenize {"tokens": [...]}  → {"prompt": "<|begin_of_text|> ..."}

The ids are the sim engine's own tokenizer's, the ones its completions count. Prompt ids are
hashes of the text's pieces, so ``/detokenize`` (and ``token_strs``) cannot give the text
back: special ids read as their markers, every other id as its filler word, the same string
whatever text it came from. Nothing here runs the model: no metrics move, and an injected
``error_rate`` does not apply (a ``hang`` does).
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gpufleet.engine._tokenizer import Tokenizer
from gpufleet.engine.server._asgi import (
    JSON_HEADERS,
    JsonRoute,
    Respond,
    Scope,
    Send,
    check_model,
    parse_body,
    send_bytes,
)
from gpufleet.engine.server._errors import InvalidRequestError
from gpufleet.engine.server._protocol import ChatMessage, ChatTemplated


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


async def _answer(body: dict[str, Any], send: Send) -> None:
    await send_bytes(send, 200, json.dumps(body, separators=(",", ":")).encode(), JSON_HEADERS)


class Tokenize(JsonRoute):
    """``POST /tokenize``: a prompt or a chat, tokenized as the completions routes do."""

    draws_errors = False

    def accept(self, scope: Scope, payload: Any) -> Respond:
        request: TokenizeChatRequest | TokenizeCompletionRequest = (
            parse_body(TokenizeChatRequest, payload)
            if isinstance(payload, dict) and "messages" in payload
            else parse_body(TokenizeCompletionRequest, payload)
        )
        check_model(self.engine, request.model)
        tokenizer = self.engine.tokenizer
        if isinstance(request, TokenizeChatRequest):
            ids = self._chat_ids(request)
        else:
            ids = list(tokenizer.encode(request.prompt, add_bos=request.add_special_tokens))
        body = {
            "count": len(ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": ids,
            "token_strs": [tokenizer.token_str(i) for i in ids]
            if request.return_token_strs
            else None,
        }
        return functools.partial(_answer, body)

    def _chat_ids(self, request: TokenizeChatRequest) -> list[int]:
        ids = chat_prompt_ids(self.engine.tokenizer, request)
        if request.add_special_tokens:
            ids.insert(0, self.engine.tokenizer.bos_id)
        return ids


def chat_prompt_ids(tokenizer: Tokenizer, request: ChatTemplated) -> list[int]:
    """The chat template; ``add_generation_prompt`` keeps the final ⟨assistant⟩, and
    ``continue_final_message`` leaves the last message open (no ⟨end⟩, no ⟨assistant⟩)::

        [user: Hi]                              BOS ⟨user⟩ Hi ⟨end⟩ ⟨assistant⟩
        [user: Hi, assistant: " The"] continued BOS ⟨user⟩ Hi ⟨end⟩ ⟨assistant⟩ The
    """
    explicit = "add_generation_prompt" in request.model_fields_set
    if request.continue_final_message and explicit and request.add_generation_prompt:
        raise InvalidRequestError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    ids = list(tokenizer.encode_chat([(m.role, m.text()) for m in request.messages]))
    if request.continue_final_message:
        del ids[-2:]
    elif not request.add_generation_prompt:
        del ids[-1:]
    return ids


class Detokenize(JsonRoute):
    """``POST /detokenize``: ids back to (the sim engine's reading of) text."""

    draws_errors = False

    def accept(self, scope: Scope, payload: Any) -> Respond:
        request = parse_body(DetokenizeRequest, payload)
        check_model(self.engine, request.model)
        tokenizer = self.engine.tokenizer
        for token in request.tokens:
            if not 0 <= token < tokenizer.vocab_size:
                raise InvalidRequestError(f"Token id {token} is out of vocabulary", param="tokens")
        return functools.partial(_answer, {"prompt": tokenizer.detokenize(request.tokens)})
