"""A Generate request checked and made ready to route: its fields validated, its prompt tokenized
(text, token ids or a chat), and its cache salt derived from the caller's tenant."""

from __future__ import annotations

from collections.abc import Collection

import grpc

from conductor.config import ConductorConfig
from model import ModelConfig, Tokenizer
from protos import halfmoon_pb2 as pb
from servekit import Tokens, caller_of, tenant_salt
from servekit.validation import prompt_ids_problem, sampling_problem, shown

ROLES = ("system", "user", "assistant", "tool")  # the chat roles a message may have


class Invalid(Exception):
    """A bad request field: INVALID_ARGUMENT with this message."""


class Preparer:
    """Validates and tokenizes requests for the model this cluster serves."""

    def __init__(
        self,
        config: ConductorConfig,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        model_name: str,
        policy_names: Collection[str],
    ):
        self.config = config
        self.tokenizer = tokenizer
        self._model_config = model_config  # the architecture: vocabulary and context window
        self._model_name = model_name  # the name the model loaded as (a request may use it)
        self._policy_names = policy_names  # the routing policies a request may name
        self._tokens = Tokens(config.security)  # API tokens -> tenants, for the cache salt

    def prompt(self, r: pb.GenerateRequest) -> tuple[list[int], str]:
        """Token ids of the prompt and the policy name, or Invalid naming the field."""
        c = self._model_config
        if r.model and r.model not in (self._model_name, self.config.model):
            raise Invalid(
                f"model: unknown model {shown(r.model)} (this cluster serves {self._model_name!r})"
            )
        policy = r.policy or self.config.policy
        if policy not in self._policy_names:
            raise Invalid(
                f"policy: unknown policy {shown(policy)} "
                f"(known: {', '.join(sorted(self._policy_names))})"
            )
        problem = sampling_problem(r.sampling, self.config.max_tokens_limit)
        if problem:
            raise Invalid(problem)
        for name in ("ttft_slo_ms", "tbt_slo_ms", "tpot_slo_ms"):
            value = getattr(r, name)
            if not value >= 0:  # nan too
                raise Invalid(f"{name}: must be >= 0 ms (0 = the conductor's default), got {value}")
        kind = r.WhichOneof("prompt")
        if kind is None:
            raise Invalid("prompt: one of text, token_ids or chat is required")
        if kind == "text":
            if not r.text:
                raise Invalid("prompt.text: empty prompt")
            ids = self.tokenizer.encode(r.text)
        elif kind == "token_ids":
            ids = list(r.token_ids.ids)
        else:
            msgs = r.chat.messages
            if not msgs:
                raise Invalid("prompt.chat: no messages")
            for i, m in enumerate(msgs):
                if m.role not in ROLES:
                    raise Invalid(
                        f"prompt.chat.messages[{i}].role: {shown(m.role)} is not one of "
                        f"{', '.join(ROLES)}"
                    )
            chat = [{"role": m.role, "content": m.content} for m in msgs]
            ids = self.tokenizer.apply_chat_template(chat)
        # Empty (after tokenization), outside the vocabulary, or no room in the context window.
        problem = prompt_ids_problem(f"prompt.{kind}", ids, c.vocab_size, c.max_position_embeddings)
        if problem:
            raise Invalid(problem)
        return list(ids), policy

    def salt(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> str:
        """The request's cache salt. With API tokens configured, a client's salt is its tenant's,
        derived here, with the salt it asked for scoped under it: one tenant never reaches
        another's blocks (so cached-token counts never cross tenants). Internal callers (the
        cluster token, e.g. a front end that authenticates its own users) and open clusters keep
        the salt they send."""
        security = self.config.security
        if not security.api_tokens:
            return request.cache_salt
        caller = caller_of(context, self._tokens)
        if caller.internal:
            return request.cache_salt
        return tenant_salt(security, caller.tenant, request.cache_salt)
