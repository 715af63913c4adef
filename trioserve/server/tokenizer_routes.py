"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and
``GET /tokenizer_info``, with the server's own tokenizer.

A client that scores text with token-id prompts (lm-evaluation-harness's
``local-completions``) learns here how the served model tokenizes, with no
hub and no local copy of the tokenizer. The bodies are read and bounded by
:mod:`trioserve.openai.tokenize`; tokenizing runs through the generations'
:class:`~trioserve.generation.Tokenizing` (long texts in its worker thread),
so these routes take no engine slot and wait on no generation.
"""

from __future__ import annotations

from urllib.parse import parse_qs

import attrs

from trioserve import openai as oa

from .http_types import HTTPRequest, Response, Router
from .models import ModelError, Models
from .routes import http_errors, model_error
from .served import ServedModel

__all__ = ["TokenizerRoutes"]


@attrs.define
class TokenizerRoutes:
    """``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``
    of the model a request names (``model`` in the body, ``?model=`` on
    ``/tokenizer_info``; the default model otherwise)."""

    models: Models
    limits: oa.TokenizerLimits = attrs.Factory(oa.TokenizerLimits)

    def install(self, router: Router) -> None:
        router.add("POST", "/tokenize", http_errors(self.tokenize))
        router.add("POST", "/detokenize", http_errors(self.detokenize))
        router.add("GET", "/tokenizer_info", http_errors(self.tokenizer_info))

    async def _served(self, name: str | None) -> ServedModel:
        try:
            return await self.models.acquire(name)
        except ModelError as exc:
            raise model_error(exc) from None

    async def tokenize(self, request: HTTPRequest) -> Response:
        parsed = oa.parse_tokenize_request(request.body, self.limits)
        served = await self._served(oa.requested_model(request.body))
        tokenizing = served.tokenizing
        ids = await tokenizing.encode(parsed.prompt)
        texts = await tokenizing.token_texts(ids) if parsed.return_token_strs else None
        return Response(200, oa.tokenize_response(ids, served.info.context_length, texts))

    async def detokenize(self, request: HTTPRequest) -> Response:
        served = await self._served(oa.requested_model(request.body))
        info = served.info
        parsed = oa.parse_detokenize_request(request.body, info.vocab_size, self.limits)
        text = await served.tokenizing.decode(list(parsed.tokens))
        return Response(200, oa.detokenize_response(text))

    async def tokenizer_info(self, request: HTTPRequest) -> Response:
        named_model = parse_qs(request.head.query).get("model")
        served = await self._served(named_model[0] if named_model else None)
        info = served.info
        template = served.chat_template
        named = dict(template.special_tokens) if template is not None else {}
        decode = served.tokenizing.engine.decode
        bos = named.get("bos_token")
        if bos is None and info.bos_token_id is not None:
            bos = decode([info.bos_token_id])
        eos = named.get("eos_token")
        if eos is None and info.eos_token_ids:
            eos = decode([min(info.eos_token_ids)])
        return Response(
            200,
            oa.tokenizer_info_response(
                model_max_length=info.context_length,
                vocab_size=info.vocab_size,
                bos_token=bos,
                eos_token=eos,
                pad_token=named.get("pad_token"),
                chat_template=template.source if template is not None else None,
            ),
        )
