"""The internal coordinator <-> worker contract, version 10: what a coordinator posts to a worker's
`POST /worker/generate` and the SSE events the worker streams back, and the embedding request a
coordinator posts to `POST /worker/embed` with its one JSON answer.

Owns: the generation request (a prompt, or a list of chat messages the worker renders with the
model's own chat template; sampling; session), the token/done/error events, and every name both
sides must agree on (path, headers, event names, ping interval, protocol version).
Must not: describe a public API. Public surfaces (`/coordinator/infer`, the OpenAI routes) have
their own request types and adapters in the coordinator; only this contract crosses to workers.

Versioning: the coordinator sends `PROTOCOL_HEADER: PROTOCOL_VERSION` with every request and
workers report `protocol` in their heartbeats. A worker refuses a request of another version with
400 `protocol_mismatch`; the coordinator refuses heartbeats from workers of another version, so a
mixed fleet never routes a request a worker would misread. Version 2 added `GenerateRequest.tenant`
(a version 1 worker refuses the unknown field). Version 3 answers the response head before the
prompt is tokenized: the prompt's length comes in an `admitted` event (it was the `X-Prompt-Tokens`
header), and a refusal found while preparing is an `error` event before it (see `AdmittedEvent`).
Version 4 added several choices per request: `GenerateRequest.n`, `TokenEvent.choice` and
`DoneEvent.choices` (a version 3 worker refuses the unknown `n`; a request with `n` = 1 is as before
on the wire, event for event).
Version 5 moved tool calls' rendering to the worker, which knows its model's template: a chat message
may be a `tool` result or an assistant's `tool_calls`, and `GenerateRequest.tools` carries the
functions and the choice among them (a version 4 worker refuses both as unknown fields); it also
added `GenerateRequest.prefix_peer` (a worker that may hold the prompt's prefix, `PREFIX_PATH`).
Version 6 lists the sessions a worker holds in its heartbeats (`protocol.health.WorkerLoad.held`, by
digest), so every coordinator of a pool knows where each session is (an older coordinator would
refuse the unknown field).
Version 7 lists the prefix blocks a worker's cells hold (`WorkerLoad.prefixes`); version 8 what each
tenant has running and has been served there (`WorkerLoad.tenants`), from which every coordinator of
a pool counts the service the others gave each tenant (fair shares across coordinators), and each
request's priority class (`GenerateRequest.priority`): an interactive request may park a batch one's
sequence on a full worker (`WorkerLoad.parkable`, `WorkerLoad.parked`), and a raw prompt given as
token ids (`GenerateRequest.prompt_tokens`). Version 9 added a prompt's own scores
(`GenerateRequest.prompt_logprobs`, `PromptEvent`); version 10 lists the models a worker offers from its
folder in its heartbeats (`protocol.health.Heartbeat.offered`; an older coordinator would refuse the
unknown field); version 11 the model a worker is swapping to (`Heartbeat.swapping`), so that requests
for either model wait for the swap instead of finding no worker; version 12 a worker with no model loaded
(`Heartbeat.standby`: its model unloaded after WORKER_KEEP_ALIVE idle), which loads one of its folder's
models when asked, and a request's `keep_alive` (Ollama's: how long the model stays loaded once idle);
version 13 which offered models a worker would load beside those it serves (`OfferedModel.beside`:
WORKER_MAX_MODELS, a free slot and the memory), so that a coordinator asks one that unloads nothing;
version 14 continues a stream another worker began (`GenerateRequest.generated`: the tokens it already
streamed, and `GenerateRequest.token_ids` with `TokenEvent.ids`, which say which tokens each event's text
covers), so that a stream outlives its worker (an older worker would refuse both unknown fields);
version 15 keeps headroom for other tenants on the worker too (`GenerateRequest.fair_share`), and keeps a
request's cells for a while once it ends (`GenerateRequest.cache_keep`: Anthropic's `cache_control`).
Embeddings need no version of their own: a worker that does not serve them never says so in its
heartbeat (`protocol.health.Heartbeat.embeddings`), so no coordinator sends it an `EmbedRequest`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PROTOCOL_VERSION = 15
GENERATE_PATH = "/worker/generate"
# Open even with a worker token (probes cannot send one); the coordinator reads it before it registers
# a new worker (coordinator/pool/probe.py).
HEALTH_PATH = "/worker/health"
# `DELETE {SESSIONS_PATH}/{session_id}?tenant=...`: end a kept session (204, or 404 when that tenant has none).
SESSIONS_PATH = "/worker/sessions"
# `PUT/GET/DELETE {RESPONSES_PATH}/{response_id}?tenant=...`: a stored Responses record (worker/api/records.py).
RESPONSES_PATH = "/worker/responses"
RESPONSE_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,160}$"
# `POST {RESPONSES_HANDOVER_PATH}?max_bytes=...`: a draining worker's records, taken (oldest first) to move them.
RESPONSES_HANDOVER_PATH = RESPONSES_PATH + "/handover"
EMBED_PATH = "/worker/embed"
# The model's tokenizer (`TokenizeWork` -> protocol.tokens.TokenizeResponse; protocol.tokens.DetokenizeRequest ->
# DetokenizeResponse): no sequence, no KV, only the text.
TOKENIZE_PATH = "/worker/tokenize"
DETOKENIZE_PATH = "/worker/detokenize"
TOKENIZER_INFO_PATH = "/worker/tokenizer_info"
# A peer worker asks for the cells of the longest prefix of a prompt held here (worker/api/transfer.py).
PREFIX_PATH = "/worker/prefix"
# Serve another model of the worker's folder (`ModelLoadRequest` -> `ModelLoadAnswer`; worker/api/swap.py).
MODEL_LOAD_PATH = "/worker/models/load"
# Seconds a model that failed to load is refused (503 `model_load_failed`) before a worker tries it again;
# a coordinator answers the failure as long without asking again (coordinator/pool/loads.py).
MODEL_LOAD_BACKOFF = 30.0
# A session's KV blob, as `GET`/`PUT {SESSIONS_PATH}/{id}/kv` and PREFIX_PATH carry it (its own format:
# worker/sessions/transfer.py).
KV_MEDIA_TYPE = "application/octet-stream"

# Headers (lower case: both HTTP stacks compare them case-insensitively).
PROTOCOL_HEADER = "x-llm-pool-protocol"
REQUEST_ID_HEADER = "x-request-id"
WORKER_ID_HEADER = "x-worker-id"
# Coordinator -> worker: the coordinator's reference of this stream (an integer below 2**63). The
# worker lists the references of the streams that hold a session in every heartbeat
# (`WorkerLoad.streams`), so the coordinator knows exactly which of its streams a heartbeat counts.
STREAM_REF_HEADER = "x-stream-ref"
MAX_STREAM_REF = (1 << 63) - 1
# Coordinator -> worker: "this session_id continues a conversation you hold". A worker that does not
# hold it answers 404 unknown_session instead of starting a new conversation under the same id.
SESSION_EXPECTED_HEADER = "x-session-expected"

# SSE event names (the `event:` line of each Server-Sent Event).
EVENT_ADMITTED = "admitted"  # worker -> coordinator only: the first event of a stream (AdmittedEvent)
EVENT_TOKEN = "token"
# worker -> coordinator only, with `prompt_logprobs`: the prompt's tokens scored, before any token (PromptEvent)
EVENT_PROMPT = "prompt"
EVENT_DONE = "done"
EVENT_ERROR = "error"

# Seconds between SSE comment pings on a worker stream, from its response head on (prefill included).
# Short, so that the coordinator's read timeout on a worker stream (several of these) finds a hung
# worker within seconds, before and after its first token; a ping is 8 bytes.
PING_INTERVAL = 1.0

FinishReason = Literal["stop", "length", "cancelled"]
Role = Literal["system", "user", "assistant", "tool"]

MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 64
MAX_PROMPT_CHARS = 1_000_000
MAX_ALTERNATIVES = 20  # OpenAI's top_logprobs at most
MAX_PROMPT_ALTERNATIVES = 5  # OpenAI's legacy `logprobs` at most, which `echo` applies to the prompt
PROMPT_EVENT_TOKENS = 256  # prompt tokens one `prompt` event scores: an event stays far below SSE's bound
MAX_MESSAGES = 1_024
MAX_GRAMMAR_CHARS = 65_536
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries
MAX_KEEP_ALIVE = 366 * 86_400.0  # seconds a request's keep_alive may ask for (a year; negative: for good)
MAX_EMBED_INPUTS = 2_048  # OpenAI's bound on the inputs of one embedding request
MAX_EMBED_DIMENSIONS = 1 << 16
MAX_TOOLS = 128  # functions offered to one request
MAX_PARALLEL_CALLS = 8  # calls in one answer, with `ToolUse.parallel`
TOOL_MODES = ("none", "auto", "required")  # `ToolUse.choice`, or the name of the one function to call
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
SESSION_ID_PATTERN = r"^[A-Za-z0-9._:\-]{1,128}$"
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/\-]{0,127}$"
TENANT_PATTERN = r"^[A-Za-z0-9._:-]{0,64}$"
# A block of a request's text as the coordinators' prefix index names it (coordinator/affinity/prefixes.py):
# 8 bytes of a chained BLAKE2b, in hex. A request carries at most MAX_PREFIX_BLOCKS of them.
PREFIX_BLOCK_PATTERN = r"^[0-9a-f]{16}$"
MAX_PREFIX_BLOCKS = 1024
# The most choices one request may ask for on this wire (OpenAI's own bound on `n`); a coordinator
# sets its own, smaller, bound (`MAX_CHOICES`), and a worker cannot run more than its sequences.
MAX_CHOICES = 128
# The most tokens a continuation may say were generated already (`GenerateRequest.generated`): max_tokens' bound.
MAX_GENERATED = 32_768


class CalledFunction(BaseModel):
    """A function an assistant's turn called, as the conversation hands it back."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(max_length=64)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS, description="the arguments as the client sent them: "
                           "a JSON text, normally an object")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    content: str = Field(max_length=MAX_PROMPT_CHARS)
    tool_calls: tuple[CalledFunction, ...] = Field(default=(), max_length=64,
                                                   description="an assistant's turn: the functions it called")
    name: str | None = Field(default=None, max_length=64,
                             description="a `tool` turn: the function whose result `content` is")

    @model_validator(mode="after")
    def _calls_are_the_assistants(self) -> Self:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant's turn makes calls")
        return self

    def said(self) -> str:
        """Everything the turn says as one text (a tool turn's function, the content, the calls), for
        fingerprints and sizes."""
        named = f"{self.name}\0" if self.name else ""
        return named + self.content + "".join(f"\0{c.name}\0{c.arguments}" for c in self.tool_calls)


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str = Field(default="", max_length=4096)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                       description="the JSON schema of the arguments")


class ToolUse(BaseModel):
    """The functions a chat may call and how: the worker lists them the way its model's template does
    (or in the generic format, worker/backends/tool_format.py) and holds a call to their schemas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    functions: tuple[ToolFunction, ...] = Field(min_length=1, max_length=MAX_TOOLS)
    choice: str = Field(default="auto", max_length=64, description="none (listed, never held to a call), auto "
                        "(held to a call once the answer starts one), required (a call to any), or the name of "
                        "the one function to call")
    parallel: bool = Field(default=True, description=f"an answer may make up to {MAX_PARALLEL_CALLS} calls")

    @model_validator(mode="after")
    def _choice_names_a_function(self) -> Self:
        names = [f.name for f in self.functions]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions share a name")
        if self.choice not in TOOL_MODES and self.choice not in names:
            raise ValueError(f"tools.choice: {self.choice!r} is neither one of {', '.join(TOOL_MODES)} nor a "
                             "function's name")
        return self

    @property
    def forced(self) -> bool:
        """The answer must be a call (required, or a named function)."""
        return self.choice not in ("none", "auto")

    def text_bytes(self) -> int:
        return sum(len(f.name) + len(f.description.encode()) + len(json.dumps(f.parameters).encode())
                   for f in self.functions)


class GenerationFields(BaseModel):
    """The fields every generation request shares, public or internal: model, sampling, session.
    Strict: a number is a JSON number and a flag a JSON boolean (`"5"` and `true` are not 5 and 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(default=None, max_length=256, description="None: the worker's own model")
    max_tokens: int = Field(default=128, ge=1, le=32_768)
    temperature: float = Field(default=0.8, ge=0.0, le=5.0, description="0 means greedy")
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    top_k: int = Field(default=40, ge=0, le=100_000, description="0 disables top-k")
    seed: int | None = Field(default=None, ge=0, le=2**32 - 2)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    session_id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
    ignore_eos: bool = Field(default=False, description="keep generating past end-of-generation tokens")
    raw: bool = Field(default=False, description="True: complete the prompt as is, no chat template")
    grammar: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS,
                                description="GBNF (llama.cpp's grammar format, a `root` rule): the answer is "
                                "constrained to what it accepts; invalid: 400")
    json_schema: dict[str, Any] | None = Field(default=None, description="a JSON schema the answer must match "
                                               "(turned into a grammar); invalid or unsupported: 400")
    grammar_lazy: bool = Field(default=False, description="the grammar (or json_schema) holds the answer only "
                               "if the answer's first token that is not whitespace starts what it accepts; "
                               "otherwise the answer is free (tool_choice auto: a call is held to its schema)")
    logit_bias: dict[str, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS,
                                         description="token id (as a string, JSON's keys) -> -100..100 added to "
                                         "its logit before sampling; -100 keeps it out in effect")
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0, description="llama.cpp's repetition penalty: "
                                  "the logit of a token among the last `repeat_last_n` tokens (the prompt's "
                                  "included) is divided by it when positive, multiplied when negative; 1 is off")
    repeat_last_n: int = Field(default=64, ge=0, le=4_096, description="how many of the latest tokens "
                               "`repeat_penalty` looks at; 0 turns it off")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="taken off the logit of every "
                                    "token generated so far")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="taken off once per time a "
                                     "token was generated so far")
    keep_alive: float | None = Field(default=None, ge=-MAX_KEEP_ALIVE, le=MAX_KEEP_ALIVE, description="Ollama's "
                                     "keep_alive: seconds the model stays loaded for this request's tenant once "
                                     "idle, from that tenant's last use (on a worker offering a folder, "
                                     "--model-dir; elsewhere the model is never unloaded), at most "
                                     "WORKER_KEEP_ALIVE_MAX; it only lengthens the model's stay (the operator's "
                                     "WORKER_KEEP_ALIVE and other tenants' stays still hold): 0 withdraws this "
                                     "tenant's own stay, a negative number is WORKER_KEEP_ALIVE_MAX (a pin only "
                                     "where that is -1); null: this tenant asks nothing")

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, value: dict[str, float]) -> dict[str, float]:
        for token, bias in value.items():
            if not (token.isascii() and token.isdigit() and len(token) <= 9):
                raise ValueError(f"logit_bias: keys are token ids, not {token[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: {token}: biases go from -100 to 100")
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> Self:
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("give either grammar or json_schema, not both")
        if self.grammar_lazy and self.grammar is None and self.json_schema is None:
            raise ValueError("grammar_lazy applies to a grammar or json_schema, and none is given")
        if self.ignore_eos and (self.grammar is not None or self.json_schema is not None):
            raise ValueError("ignore_eos cannot be combined with a grammar or json_schema: the grammar decides "
                             "where the answer ends")
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_strings_bounded(cls, value: list[str]) -> list[str]:
        for item in value:
            if not item or len(item) > MAX_STOP_LENGTH:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_LENGTH} characters")
        return value


class GenerateRequest(GenerationFields):
    """One generation: exactly one of `prompt` (a single user turn, or raw text) and `messages`
    (the whole conversation, rendered by the worker with the model's chat template)."""

    prompt: str | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    # A raw prompt given as token ids (OpenAI's `prompt: [1, 2, 3]`), in place of `prompt`: taken as given
    # (no begin-of-text token added); each id is checked against the model's vocabulary.
    prompt_tokens: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1,
                                                                     max_length=MAX_PROMPT_CHARS)
    max_tokens: int = Field(default=128, ge=0, le=32_768, description="0: only with `prompt_logprobs` (the "
                            "prompt scored, nothing generated)")
    alternatives: int = Field(default=0, ge=0, le=MAX_ALTERNATIVES,
                              description="the most likely tokens to report at each generated token, with their "
                              "log-probabilities (OpenAI's `top_logprobs`; `TokenEvent.top`), 0: none")
    probabilities: bool = Field(default=True, description="False: token events carry `probability: null` and "
                                "the worker skips the softmax over the vocabulary that a probability needs "
                                "(a surface whose client did not ask for them)")
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_PROMPT_ALTERNATIVES,
        description="score the prompt: before any token, one `prompt` event (PromptEvent) with each prompt "
        "token's log-probability given the tokens before it, and this many most likely tokens at each "
        "position. The whole prompt is prefilled (no cached cells: they hold no logits). None: not scored")
    # Internal only (not in GenerationFields, which public surfaces share): a client never names its
    # own tenant; the coordinator derives it from the API key it authenticated.
    tenant: str = Field(default="", pattern=TENANT_PATTERN,
                        description="the tenant the coordinator serves this request for, derived from the "
                                    "client's API key (\"\" when the pool has no keys). The worker keeps each "
                                    "tenant's sessions, prompt cache and prefix copies apart: another tenant's "
                                    "session id names nothing, and its cached prompts are never reused")
    # Internal only: public surfaces that offer several choices (OpenAI's `n`) map onto it.
    n: int = Field(default=1, ge=1, le=MAX_CHOICES,
                   description="choices generated from the one prompt: it is prefilled once and its cells copied "
                               "to n sequences; each choice samples on its own (with `seed`, choice i > 0 draws "
                               "from a seed derived from (seed, i)) and ends on its own. Not with `session_id`")
    # Internal only: the coordinator's hint that another worker holds more of this prompt's prefix.
    prefix_peer: str | None = Field(default=None, max_length=2048, pattern=r"^https?://",
                                    description="the URL of a worker of the same model that was sent more of this "
                                    "prompt's prefix: this worker may fetch those cells from it (`POST "
                                    "/worker/prefix`) instead of prefilling them, when that saves at least "
                                    "WORKER_PEER_PREFIX_MIN_TOKENS")
    # Internal only: the prompt's prefix blocks as the coordinator's prefix index hashed them.
    prefix_blocks: list[Annotated[str, Field(pattern=PREFIX_BLOCK_PATTERN)]] | None = Field(
        default=None, max_length=MAX_PREFIX_BLOCKS,
        description="the chained hashes of this request's text in blocks, from the first: the worker keeps "
                    "them with the sequence whose cells hold the prompt and lists them in its heartbeats "
                    "(`WorkerLoad.prefixes`) while they do, so every coordinator's prefix index holds what "
                    "the workers hold, whichever coordinator sent the prompt")
    # Internal only: the OpenAI surfaces' `tools` and `tool_choice`, for a chat (`messages`).
    tools: ToolUse | None = Field(default=None, description="functions the answer may call; the worker tells "
                                  "the model about them and holds a call to their schemas (unless `grammar` "
                                  "or `json_schema` holds the answer, which a forced call does not allow)")
    # Internal only: the tenant's fair-share weight (its key's), which the worker's line applies.
    tenant_weight: float = Field(default=1.0, gt=0.0, le=1_000_000.0, description="the tenant's fair-share weight: "
                                 "a worker prefills first the prompts of the tenant with the fewest sequences "
                                 "decoding there for its weight (worker/engine/line.py)")
    # Anthropic's `cache_control` (coordinator/surfaces/anthropic.py): how long this request's cells are kept.
    cache_keep: float | None = Field(default=None, gt=0.0, le=3600.0, description="seconds this request's cells "
                                     "(prompt and answer) stay in its sequence once it ends, the last of the free "
                                     "sequences to be reused (worker/sessions/table.py, kept leftovers)")
    # Internal only: the coordinator keeps fair shares between tenants (its keys' weights).
    fair_share: bool = Field(default=False, description="the worker keeps the last free sequences for the other "
                             "tenants active here while this request's tenant holds its weighted share of them or "
                             "more (worker/headroom.py)")
    # Internal only: what a coordinator needs to continue this stream on another worker should this one fail.
    token_ids: bool = Field(default=False, description="every `token` event carries `ids`: the generated tokens "
                            "its text covers (TokenEvent.ids)")
    # Internal only: a continuation of a stream whose worker failed after it had streamed some of the answer.
    generated: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, max_length=MAX_GENERATED,
        description="tokens an earlier worker already generated for this request and the client already received "
        "(a continuation after that worker failed; the `ids` of its token events, in order): the worker prefills "
        "them after the prompt, advances the grammar, the penalties and a seeded request's draws over them as if "
        "it had sampled them, and generates the rest. They count as completion tokens (the first new token's "
        "`index` is their number, `max_tokens` includes them, `usage.completion_tokens` counts them, "
        "`usage.prompt_tokens` does not); a grammar that refuses one: 400. One choice only, no prompt_logprobs")
    # Internal only: the class the coordinator resolved for the request (its key's default, or what it asked).
    priority: Literal["interactive", "batch"] = Field(
        default="interactive", description="its priority class: on a worker whose every sequence is taken, an "
        "interactive request parks a running batch request (its cells to host memory, its sequence freed), "
        "which resumes where it stopped once a sequence is free; batch requests never park anything, and "
        "never take a sequence a parked one waits for")

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> GenerateRequest:
        if sum(given is not None for given in (self.prompt, self.prompt_tokens, self.messages)) != 1:
            raise ValueError("give exactly one of prompt, prompt_tokens and messages")
        if self.prompt_tokens is not None and not self.raw:
            raise ValueError("prompt_tokens: a prompt of token ids is raw (raw: true)")
        if self.raw and self.messages is not None:
            raise ValueError("raw applies to a prompt, not to messages")
        if self.n > 1 and self.session_id is not None:
            raise ValueError("n: several choices cannot continue a session (which one would the next turn "
                             "continue?); leave out session_id or ask for one choice")
        if self.tools is not None:
            if self.messages is None:
                raise ValueError("tools: apply to a chat (messages), not to a prompt")
            if self.tools.forced and (self.grammar is not None or self.json_schema is not None):
                raise ValueError("tools: a required call cannot also be held to a grammar or json_schema")
        return self

    @model_validator(mode="after")
    def _generates_or_scores(self) -> GenerateRequest:
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens: 0 only when the prompt is scored (prompt_logprobs)")
        return self

    @model_validator(mode="after")
    def _continues_one_answer(self) -> GenerateRequest:
        if self.generated is None:
            return self
        if self.n != 1:
            raise ValueError("generated: a continuation continues one answer (n: 1)")
        if self.prompt_logprobs is not None:
            raise ValueError("generated: a continuation does not score its prompt again (no prompt_logprobs)")
        if self.max_tokens <= len(self.generated):
            raise ValueError(f"max_tokens: {self.max_tokens} leaves nothing to generate after the "
                             f"{len(self.generated)} tokens already generated")
        return self

    def prompt_bytes(self) -> int:
        """UTF-8 bytes of the text the worker will template and tokenize (an upper bound on tokens)."""
        if self.prompt is not None:
            return len(self.prompt.encode())
        if self.prompt_tokens is not None:
            return len(self.prompt_tokens)  # exact: one token each
        listed = self.tools.text_bytes() if self.tools is not None else 0
        return listed + sum(len(m.said().encode()) for m in self.messages or ())


class PrefixRequest(BaseModel):
    """A worker asks a peer for the cells of the longest prefix of `tokens` it holds for `tenant`."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[int] = Field(min_length=1, max_length=1 << 20)
    tenant: str = Field(default="", pattern=TENANT_PATTERN)
    at_least: int = Field(default=1, ge=1, description="a shorter prefix is not worth sending: 404 `no_prefix`")


class TokenEvent(BaseModel):
    """One piece of generated text.

    `token` is the text of one generated token, or of several when a UTF-8 character or a possible
    stop string spans tokens (the text is held until it is complete). `index` is the 0-based position,
    among generated tokens, of the last token the text includes; `probability` is the product of the
    included tokens' softmax probabilities under the model's raw logits, or None when the request
    said `probabilities: false` (never on the public `/coordinator/infer`, which always asks).
    """

    token: str
    index: int = Field(ge=0)
    probability: float | None = Field(ge=0.0, le=1.0)
    finished: Literal[False] = False
    top: list[tuple[str, float]] | None = Field(
        default=None, max_length=MAX_ALTERNATIVES, exclude_if=lambda v: v is None,
        description="with `alternatives`: the most likely tokens at the first token of this text, most likely "
        "first, each with its log-probability under the raw logits; left out otherwise")
    choice: int = Field(default=0, ge=0, lt=MAX_CHOICES, exclude_if=lambda v: v == 0,
                        description="which of the request's `n` choices the text belongs to; left out when 0 (so "
                        "always with n = 1, as before `n` existed)")
    ids: list[int] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="with `token_ids`: the generated tokens this text covers, in order (several when the text was "
        "held for a UTF-8 character or a possible stop string). A stream's ids, event after event, are exactly "
        "the tokens whose text reached the client: a token whose text is still held is in no event yet (text is "
        "released at token boundaries only), and one a stop string cut off whole is in none. Left out otherwise")


class PromptEvent(BaseModel):
    """Some of the prompt's tokens scored (a request with `prompt_logprobs`): after `admitted` and before
    any `token` event come the whole prompt's, in order, at most PROMPT_EVENT_TOKENS to an event.
    `logprobs[i]` is the log-probability of the prompt's token `start + i` given the tokens before it,
    under the model's raw logits (None for the prompt's first, which nothing predicts); `top[i]` the
    most likely tokens there, most likely first (empty at the first, and when none were asked for)."""

    start: int = Field(ge=0, description="the prompt position of this event's first token")
    tokens: list[str] = Field(max_length=PROMPT_EVENT_TOKENS,
                              description="each token's text; a partial UTF-8 character as U+FFFD")
    logprobs: list[float | None] = Field(max_length=PROMPT_EVENT_TOKENS)
    top: list[list[tuple[str, float]]] = Field(max_length=PROMPT_EVENT_TOKENS)


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0, description="tokens of the prompt as the model saw it (after templating)")
    cached_tokens: int = Field(ge=0, description="prompt tokens reused from KV already held, not prefilled")
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class Timings(BaseModel):
    queue_ms: float = Field(ge=0.0, description="admitted until its first decode step")
    prefill_ms: float = Field(ge=0.0, description="first decode step until the prompt was in the KV cache")
    ttft_ms: float = Field(ge=0.0, description="admitted until the first token was produced")
    total_ms: float = Field(ge=0.0, description="admitted until the last token")
    tokens_per_second: float = Field(ge=0.0, description="completion tokens / (total - ttft)")


class ChoiceEnd(BaseModel):
    """How one choice of a request with `n` > 1 ended (`DoneEvent.choices`, in choice order)."""

    finish_reason: FinishReason
    completion_tokens: int = Field(ge=0)


class DoneEvent(BaseModel):
    """The end of a request. With `n` > 1 choices it comes once, when the last choice has ended:
    `usage.completion_tokens` counts every choice's tokens (the prompt once), `finish_reason` is
    `cancelled` if the request was, else `length` if any choice ran out of tokens, else `stop`, and
    `choices` says how each one ended. With one choice, `choices` is left out of the JSON."""

    finished: Literal[True] = True
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    request_id: str
    worker_id: str
    model: str
    session_id: str | None = None
    cached: bool = Field(default=False, description="replayed from the coordinator's response cache: nothing "
                         "was computed (completion_tokens 0)")
    # Left out of the JSON when None, so a one-choice `done` is what it was before `n` existed
    # (/coordinator/infer passes it through as is, and the response cache replays it).
    choices: list[ChoiceEnd] | None = Field(default=None, max_length=MAX_CHOICES, exclude_if=lambda v: v is None,
                                            description="with n > 1: each choice's ending, in choice order")


class AdmittedEvent(BaseModel):
    """A worker stream's first event: the prompt is tokenized and its session and KV are reserved.

    A worker answers the response head (and pings) as soon as the checks that need no tokenizing pass,
    so that its silence always means a hung worker, never a long prompt. What it finds while preparing
    (the prompt too long for a session, no sequence or KV free, the session taken meanwhile) is an
    `error` event *instead of* this one, with the refusal's reason: nothing ran, and the coordinator
    treats it as the status the reason names (a 503 reason: the next worker may take it).
    """

    prompt_tokens: int = Field(ge=0, description="the templated prompt's length in tokens")


class ErrorEvent(BaseModel):
    """Sent as the last event when a stream that has started cannot complete (or, before `admitted`,
    when the worker refuses it: see `AdmittedEvent`)."""

    error: str
    reason: str
    request_id: str
    finished: Literal[True] = True


class ErrorBody(BaseModel):
    """Every non-2xx JSON body of a worker (and of the coordinator's own `/coordinator/*` routes)."""

    error: str
    reason: str
    request_id: str


class EmbedRequest(BaseModel):
    """`POST /worker/embed`: texts to embed with the worker's model, each into one vector.

    Each input is tokenized as it is (with the model's special tokens, no chat template) and must fit
    the worker's embedding context whole: a longer one is refused (413 `prompt_too_long`), never cut.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(default=None, max_length=256, description="None: the worker's own model")
    inputs: list[Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]] = Field(
        min_length=1, max_length=MAX_EMBED_INPUTS)
    dimensions: int | None = Field(default=None, ge=1, le=MAX_EMBED_DIMENSIONS,
                                   description="the size the caller expects; another than the model's: 400")
    tenant: str = Field(default="", pattern=TENANT_PATTERN, description="the tenant it is computed for (logs)")

    def input_bytes(self) -> int:
        return sum(len(text.encode()) for text in self.inputs)


class EmbedResponse(BaseModel):
    """The answer to an `EmbedRequest`: one unit-length vector per input, in input order.

    Each vector is base64 of little-endian float32 values (what OpenAI's `encoding_format: "base64"`
    sends), so it crosses exactly and at a third of the size of JSON numbers.
    """

    model: str
    dimensions: int = Field(ge=1, le=MAX_EMBED_DIMENSIONS)
    embeddings: list[str] = Field(max_length=MAX_EMBED_INPUTS)
    prompt_tokens: list[int] = Field(max_length=MAX_EMBED_INPUTS, description="each input's length in tokens")
    request_id: str
    worker_id: str


class TokenizeWork(BaseModel):
    """A prompt, or a chat conversation (rendered as a generation's prompt is), to tokenize."""

    model: str | None = Field(default=None, max_length=256)
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special: bool = Field(description="the model's begin-of-text token(s) added by the tokenizer")
    token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeWork:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class ModelLoadRequest(BaseModel):
    """Serve this model of the worker's folder (`--model-dir`), by its name or an alias, in place of the
    one it serves: once its streams have ended and its kept sessions have moved or ended."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=128, pattern=MODEL_NAME_PATTERN)


class ModelLoadAnswer(BaseModel):
    """200: the model is served now (`loaded`); 202: the swap to it is under way (`loading`), the one
    swap the worker runs (a second request for the same model joins it)."""

    model: str
    state: Literal["loaded", "loading"]
