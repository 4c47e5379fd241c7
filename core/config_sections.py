"""The config file's sections (pydantic): each section's docstring and each
setting's `description` are the documentation, rendered into docs/CONFIG.md
and `mlxd config reference` by mlxd.config_reference. The whole document
(models, aliases and the checks across sections) is mlxd.config_schema.

Here: the models, embeddings, supervisor and gateway sections, and what
every section shares (`Strict`, the setting types, the host checks); the
`[engine]` section and its subsections are mlxd.config_engine."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ContextOverflow = Literal["error", "truncate_middle"]  # engine/model/context_overflow.py

SOURCES = ("path", "repo", "gguf", "from_ollama", "demo")  # where a model comes from: exactly one per model
LOCAL_ENGINE = "local"  # in a model's `hosts`: this machine's engine ([engine] host and port)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def engine_host_url(entry: str, local_url: str) -> str:
    """A `hosts` entry -> the engine's base URL (pure): "local" is this
    machine's engine; "host:port" is plain HTTP; a full http(s):// URL is
    used as it is (an engine behind a TLS reverse proxy)."""
    if entry == LOCAL_ENGINE:
        return local_url
    if entry.startswith(("http://", "https://")):
        return entry.rstrip("/")
    return "http://" + entry


def host_entry_problem(entry: str) -> str | None:
    """Why a `hosts` entry is unusable, or None (pure)."""
    from urllib.parse import urlsplit

    if entry == LOCAL_ENGINE:
        return None
    url = urlsplit(engine_host_url(entry, ""))
    try:
        port = url.port
    except ValueError:
        port = None
    if not url.hostname or port is None or url.path not in ("", "/") or url.query or url.username:
        return f"{entry!r} is not \"local\", \"host:port\" or \"http(s)://host:port\""
    return None


def is_loopback(host: str) -> bool:
    """Whether a bind address is reachable from this machine only (pure):
    wildcards ("0.0.0.0", "::", "") and real interfaces are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to, assume the network


KVBits = Literal[4, 8, 16]
KVGroupSize = Literal[32, 64, 128]
Speculative = Literal["prompt_lookup", "off"]


class ModelSpec(Strict):
    """One MLX model, under `[models.ID]` (the ID is the name clients ask for). Exactly one of `path`, `repo`,
    `gguf`, `from_ollama`, `demo` says where it is.

    With several `hosts`, LiteLLM's router spreads requests across them at random, sends a busy or failed host's
    request to another host and leaves a failed host out for `gateway.host_cooldown_s`; Ollama answers only when
    every host is out. docs/SCALE-OUT.md explains the set-up."""

    path: str | None = Field(default=None, description="A local model folder (config.json and *.safetensors).")
    repo: str | None = Field(default=None, description="A Hugging Face repo id, e.g. `mlx-community/...-4bit`.")
    gguf: str | None = Field(default=None, description=(
        "A local .gguf file, converted once into `$MLXD_HOME/models/gguf/` with its tensors kept as they are "
        "(F32, F16, BF16, Q4_0, Q4_1, Q8_0). Other tensor types, architectures other than llama/qwen2/qwen3 and "
        "non-BPE tokenizers are refused with `400 model_unsupported`."))
    from_ollama: str | None = Field(default=None, description=(
        "An Ollama model name (`qwen3:4b`): its GGUF from Ollama's store (`$OLLAMA_MODELS`, default "
        "`~/.ollama/models`), converted as `gguf` is; the same name is its Ollama fallback."))
    demo: Literal["a", "b", "vision"] | None = Field(default=None, description=(
        "A built-in demo model with random weights (`\"vision\"`: a tiny vision-language model)."))
    ollama: str | None = Field(default=None, description=(
        "The Ollama model the gateway falls back to for this one. Unset: `from_ollama`, else "
        "`gateway.default_ollama_model`."))
    context_tokens: int | None = Field(default=None, gt=0, description=(
        "The KV allowance in this model's memory estimate. Unset: `engine.context_tokens`."))
    max_concurrency: int | None = Field(default=None, ge=1, le=64, description=(
        "Requests generated at once for this model. Unset: `engine.max_concurrency`."))
    context_overflow: ContextOverflow | None = Field(default=None, description=(
        "A conversation longer than this model's context. Unset: `engine.context_overflow`."))
    extend_context: int | None = Field(default=None, ge=1024, le=1 << 21, description=(
        "Serve the model with this context, in tokens, by YaRN RoPE scaling over the one it was trained on (its "
        "config's `max_position_embeddings`; a model whose config already scales its RoPE is served as it is). "
        "The default model (SmolLM2-135M, trained on 8,192) is served with 32,768: an agent's 20k-token prompt "
        "fits. Quality falls with the factor (docs/BENCHMARKS.md measures it): prefer a model trained on the "
        "context you need."))
    speculative: Speculative | None = Field(default=None, description=(
        "Speculative decoding for this model. Unset: `engine.speculative`."))
    draft: str | None = Field(default=None, description=(
        "A smaller model of the same tokenizer, by its id under `[models]`, that proposes this one's next tokens "
        "(speculative decoding by a draft model instead of prompt lookup: its greedy tokens verified by this one in "
        "one forward; `speculative = \"off\"` turns it off). It is loaded and unloaded with this model, and its "
        "weights and one KV are counted in this model's memory estimate: one request at a time drafts, the others "
        "of a batch decode plain. A draft whose tokenizer differs is refused at load."))
    draft_tokens: int = Field(default=3, ge=1, le=16, description=(
        "Tokens the draft model proposes per forward of this one (mlx-lm's `num_draft_tokens`)."))
    kv_bits: KVBits | None = Field(default=None, description="Its KV cache's precision. Unset: `engine.kv_bits`.")
    kv_group_size: KVGroupSize | None = Field(default=None, description=(
        "Its quantised KV's group size. Unset: `engine.kv_group_size`."))
    quantized_kv_start: int | None = Field(default=None, ge=0, description=(
        "Where its KV quantisation starts. Unset: `engine.quantized_kv_start`."))
    hosts: list[str] = Field(default_factory=lambda: [LOCAL_ENGINE], min_length=1, description=(
        "The engines that serve it: `\"local\"` (this machine's) and/or `\"host:port\"` (or `\"https://host:port\"` "
        "behind a TLS reverse proxy) of other Macs running mlxd with the same model id and "
        "`engine.require_key = true`, holding this machine's `engine.key`."))

    @property
    def fallback_ollama(self) -> str | None:
        """The Ollama model that answers when the engine cannot."""
        return self.ollama or self.from_ollama

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "ModelSpec":
        given = [k for k in SOURCES if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(SOURCES)} (got {given or 'none'})")
        for entry in self.hosts:
            problem = host_entry_problem(entry)
            if problem:
                raise ValueError(f"hosts: {problem}")
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError("hosts: an engine is listed twice")
        return self


class EmbeddingSpec(Strict):
    """One embedding model, under `[embeddings.ID]` (the ID is the name clients send to `/v1/embeddings`): a
    sentence-transformers folder (or Hugging Face repo) of an encoder mlx-vlm loads (BERT, ModernBERT, XLM-R,
    Qwen3-Embedding, Gemma embeddings...). Exactly one of `path`, `repo`. It stays resident beside the chat model
    (its memory counted in the engine's budget) and is given back with it when idle."""

    path: str | None = Field(default=None, description="A local model folder (config.json, *.safetensors, tokenizer).")
    repo: str | None = Field(default=None, description="A Hugging Face repo id, e.g. `mlx-community/...`.")
    ollama: str | None = Field(default=None, description=(
        "The Ollama embedding model the gateway falls back to for this one. Unset: `all-minilm`."))
    dimensions: list[int] = Field(default_factory=list, description=(
        "Smaller sizes the model was trained to be cut to (Matryoshka), for a request's `dimensions`; empty: only "
        "its own size."))

    @model_validator(mode="after")
    def _one_source(self) -> "EmbeddingSpec":
        if (self.path is None) == (self.repo is None):
            raise ValueError("give exactly one of path, repo")
        return self


class RerankerSpec(Strict):
    """One reranker, under `[rerankers.ID]` (the ID is the name clients send to `/v1/rerank`), from exactly one
    source: `path`/`repo`, a cross-encoder folder (a `...ForSequenceClassification` checkpoint with one label: BERT,
    XLM-R, ModernBERT, as ms-marco-MiniLM or bge-reranker; resident beside the chat model, its memory counted in the
    engine's budget, given back with it when idle); `embedding`, an `[embeddings]` id whose vectors' cosine ranks
    (no second model in memory); or `chat_model`, a chat model id or alias whose answer "yes" or "no" to "does the
    document meet the query?" ranks by its two logits (Qwen3-Reranker's way: a Mac running one big model needs no
    second)."""

    path: str | None = Field(default=None, description="A local cross-encoder folder (config.json, *.safetensors, "
                                                       "tokenizer).")
    repo: str | None = Field(default=None, description="A Hugging Face repo id of a cross-encoder.")
    embedding: str | None = Field(default=None, description=(
        "An `[embeddings]` id: documents ranked by the cosine of their vectors to the query's."))
    chat_model: str | None = Field(default=None, description=(
        "A chat model id or alias under `[models]`: documents ranked by its yes/no logits, one forward each."))
    instruction: str = Field(default="Given a search query, retrieve relevant passages that answer the query",
                             max_length=2000, description="The task `chat_model` is told (a request's "
                                                          "`instruction` replaces it).")

    @model_validator(mode="after")
    def _one_source(self) -> "RerankerSpec":
        given = [k for k in ("path", "repo", "embedding", "chat_model") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of path, repo, embedding, chat_model")
        return self

    @property
    def kind(self) -> str:
        """"cross-encoder", "embedding" or "chat"."""
        return "embedding" if self.embedding else "chat" if self.chat_model else "cross-encoder"


class SupervisorConfig(Strict):
    """Crash-aware supervision (supervisor/policy.py): backoff, crash loops, hangs. A crash after a healthy run
    restarts at once; crashes in a row back off; a crash loop stops restarts for a cool-down, while the gateway
    serves through Ollama; an engine that stops answering /health is killed and handled as a crash."""

    backoff_base_s: float = Field(default=1.0, ge=0, description=(
        "The wait before the second crash in a row is restarted; it doubles with each crash after."))
    backoff_cap_s: float = Field(default=60.0, ge=0, description="The longest wait between restarts.")
    healthy_reset_s: float = Field(default=120.0, gt=0, description=(
        "A run this long counts as healthy: a crash after it restarts at once and ends the crashes in a row."))
    loop_crashes: int = Field(default=5, ge=1, description=(
        "This many crashes within `loop_window_s` is a crash loop: the engine is left down (\"degraded\")."))
    loop_window_s: float = Field(default=600.0, gt=0, description="The window that counts `loop_crashes`.")
    cooldown_s: float = Field(default=300.0, ge=0, description=(
        "How long a crash loop leaves the engine down before one probation start (a crash before it runs healthy "
        "goes straight back). `mlxd restart` clears it at once."))
    health_interval_s: float = Field(default=1.0, gt=0, description="Seconds between the engine's /health polls.")
    health_failures: int = Field(default=3, ge=1, description=(
        "Failed /health polls in a row that make a hang: the engine is killed and handled as a crash."))
    start_grace_s: float = Field(default=120.0, ge=0, description=(
        "A starting engine's /health goes unjudged this long (it may be loading its model)."))
    quarantine_s: float = Field(default=3600.0, ge=0, description=(
        "How long a request that crashed the engine (a poison request, by its fingerprint) is refused."))
    journal_max_bytes: int = Field(default=1_000_000, ge=10_000, description=(
        "The crash journal (`$MLXD_HOME/state/crashes.jsonl`) is rotated at this size."))
    standby_engine: bool = Field(default=True, description=(
        "Keep a second engine process waiting with its Python imported and no model (about 100 MB of memory, no "
        "accelerator memory): a crashed engine's replacement is that process, which only has to load the weights "
        "(a restart about 1 s sooner). `mlxd restart` starts afresh, so new code and config are read. Not with "
        "`engine.ranks`."))
    standby_delay_s: float = Field(default=10.0, ge=0, description=(
        "Seconds after the standby engine took over (or the stack started) before the next one is started, so "
        "that its imports do not compete with the engine's own start."))


class GatewayConfig(Strict):
    """The LiteLLM gateway (gateway/): aliases, keys, the Ollama fallback."""

    host: str = Field(default="127.0.0.1", description=(
        "The gateway's bind address: `\"0.0.0.0\"` (or a bridge address) for Docker agents; the key is always "
        "required."))
    port: int = Field(default=4000, ge=1, le=65535, description="The gateway's port.")
    allowed_hosts: list[str] = Field(default_factory=list, description=(
        "Names the gateway answers to beyond its built-in ones (a DNS-rebinding guard: any IP address, "
        "`localhost`, `host.docker.internal` and this machine's own names, `name.local` too, always pass); "
        "`[\"*\"]`: any name."))
    ollama_url: str = Field(default="http://127.0.0.1:11434", description="Where Ollama answers.")
    default_ollama_model: str | None = Field(default="llama3.2:3b", description=(
        "The Ollama fallback of models without one of their own (`ollama`, `from_ollama`); unset: none."))
    only_light: bool = Field(default=False, description="Every alias serves the light model on MLX.")
    light_model: str | None = Field(default=None, description=(
        "A model id. Unset: the first model that fits the memory budget."))
    busy_spill: bool = Field(default=False, description=(
        "A busy engine sends requests on to Ollama at once instead of queueing them."))
    engine_fast_path: bool = Field(default=True, description=(
        "Relay the light model's answers from the engine as they are (gateway/fastpath.py)."))
    crash_retry_wait_s: float = Field(default=60.0, ge=0, description=(
        "A request whose engine died before its answer started (nothing streamed yet), or that arrives while the "
        "supervisor is bringing a crashed engine back, is held this long for the engine, then sent to it, once: "
        "its client sees a slower answer, not another model's. One lost at a crash with others (a batch) is sent a "
        "second time if lost again, for a restart due within 5 s, waiting at most 15 s: a bystander queued behind the "
        "request that crashed it. Past that, on a second death of a request lost alone, or while the engine is "
        "stopped or cooling down after a crash loop, Ollama answers. 0: Ollama at once."))
    host_cooldown_s: float = Field(default=5.0, gt=0, description=(
        "A host that failed (refused, reset, 5xx, wrong key) is left out this long, then tried again; a busy one "
        "(429) for its Retry-After."))
    status_sample_s: float = Field(default=5.0, ge=0.1, le=60, description=(
        "How often the status page's history (/ui: memory, requests, tok/s over the last hour) samples the "
        "engine's /health."))
    enabled: bool = Field(default=True, description="Run the gateway; `false`: the engine alone.")
