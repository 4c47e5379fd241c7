"""The config file's `[engine]` section (pydantic) and its subsections,
`[engine.prompt_cache]`, `[engine.images]` and `[engine.ranks]`: each
section's docstring and each setting's `description` are the documentation
(docs/CONFIG.md, by mlxd.config_reference). The other sections, and the
types and checks they share with this one, are mlxd.config_sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from mlxd.config_sections import ContextOverflow, KVBits, KVGroupSize, Speculative, Strict
from mlxd.durations import parse_duration


class PromptCacheConfig(Strict):
    """The prompt cache (engine/cache/prompt_cache.py): an agent's next turn reuses the KV of the conversation so far,
    from memory or, after an engine restart, from disk (`$MLXD_HOME/state/kv/`). A turn that continues a
    conversation (its prompt holds the earlier turn's, or the same aligned with a few values changed and the
    earlier answer after it) replaces that conversation's entry in memory and on disk, with or without
    `normalize`."""

    enabled: bool = Field(default=True, description="Reuse the KV of earlier prompts.")
    memory_gib: float | None = Field(default=None, ge=0, description=(
        "Memory for cached KV. Unset: half of what the resident model's estimate (weights + KV for "
        "`context_tokens`) leaves of the memory budget, never more than that."))
    disk: bool = Field(default=True, description=(
        "Evicted entries (and the last one, when idle) go to disk and survive engine restarts; `false` keeps the "
        "cache in memory only."))
    disk_gib: float | None = Field(default=None, ge=0, description=(
        "The most disk the cached entries take. Unset: as much as the memory tier may hold (every turn is written "
        "behind, so a crash finds on disk what was in memory), at least 8 GiB, never more than a quarter of the "
        "disk free at the engine's start."))
    max_read_s: float = Field(default=5.0, gt=0, description=(
        "Never read an entry from disk that is expected to take longer than this."))
    normalize: list[Literal["iso_timestamps", "clock_times", "uuids", "request_ids"]] = Field(
        default_factory=list, description=(
            "Agent-safe keys (off unless named here): text these rules match is ignored when telling which "
            "conversation a request continues, so a later turn replaces the earlier one's entry. The model always "
            "sees the real text, and reuse stops at the first real difference."))
    approximate: bool = Field(default=False, description=(
        "Approximate reuse (opt-in): in a later turn of the same conversation, keep the cached KV past a changed "
        "span of the same length (a clock, an id) and recompute only the changed tokens and a few after each. The "
        "model then sees KV computed from the old text after the change, so answers can differ from a cold run's "
        "(docs/BENCHMARKS.md measures how often); exact reuse stops at the first change."))


class ImagesConfig(Strict):
    """Images in requests to vision models (engine/api/images.py). `image_url` parts may be data URLs
    (`data:image/png;base64,...`) or, only under the folders in `local_dirs`, `file:///` URLs; the engine never
    fetches http(s) URLs (such a request goes on to Ollama). Limits are per image, except `max_per_request`."""

    local_dirs: list[str] = Field(default_factory=list, description=(
        "Folders that `file:///` image URLs may name (links resolved first); empty: none."))
    max_per_request: int = Field(default=8, ge=1, description="The most images in one request.")
    max_bytes: int = Field(default=20 * 2**20, gt=0, description="The largest encoded image, in bytes.")
    max_pixels: int = Field(default=50_000_000, gt=0, description=(
        "The largest decoded image, in pixels (width x height)."))


class RanksConfig(Strict):
    """A rank group (engine/model/ranks.py): the engine's model sharded over several processes with mlx-lm's tensor
    parallelism, started together by `mlx.launch` (the supervisor runs it as the engine; one rank dying restarts
    the group). Rank 0 is this Mac and serves HTTP. Remote ranks are started over ssh with the same Python path
    and the same mlxd config. docs/SCALE-OUT.md explains it."""

    hosts: list[str] = Field(default_factory=list, description=(
        "One IP per rank, rank 0 (this Mac) first; the same IP twice runs two ranks on one Mac. The ring backend "
        "needs IPs. Empty: one process, no sharding."))
    backend: Literal["ring", "jaccl"] = Field(default="ring", description=(
        "`ring`: TCP (Ethernet, Thunderbolt IP); `jaccl`: RDMA over Thunderbolt 5 (needs a `hostfile`)."))
    hostfile: str | None = Field(default=None, description=(
        "`mlx.distributed_config`'s output, instead of `hosts`."))
    starting_port: int = Field(default=32323, ge=1024, le=65000, description=(
        "The ring backend's first port, +1 per rank."))

    @model_validator(mode="after")
    def _a_group(self) -> "RanksConfig":
        if len(self.hosts) == 1:
            raise ValueError("hosts: a rank group has two ranks or more (leave it empty for one process)")
        if self.hostfile and self.hosts:
            raise ValueError("give hosts or hostfile, not both")
        if self.backend == "jaccl" and not self.hostfile:
            raise ValueError("backend = \"jaccl\" needs a hostfile (mlx.distributed_config --backend jaccl)")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.hosts or self.hostfile)


class EngineConfig(Strict):
    """The MLX engine (engine/): one request at a time (by default), one model, no heavy models.

    `max_concurrency` above 1 (per model: `[models.ID] max_concurrency`) decodes that many requests as one batch
    (mlxd's: each row over its own cache): more tokens per second in all and a short wait for each of several
    agents, at the price of memory. It is safe by construction: a request joins the batch only when the model, the
    KV of every running request at its full length (prompt + max_tokens) and its own fit the memory budget, else it
    waits in the queue; the prompt cache gives up memory first. Raise it where several agents share the engine and
    the model leaves room (a small model on a large Mac); keep 1 where one agent at a time is the rule or memory is
    tight. Requests with a `seed` or images are served alone in their turn; `batching = "auto"` serves one at a
    time where the batch was measured slower at the model's load, and on the CPU.

    `kv_bits` 8 or 4 (per model too) keeps the KV cache quantised (mlx-lm's QuantizedKVCache: per `kv_group_size`
    values a scale and a bias): about 1.9x or 3.5x the context, or the prompt cache's conversations, in the same
    memory, at a small cost in quality that docs/BENCHMARKS.md measures; the memory estimate, admission and the
    prompt cache count the quantised size, and cached entries are never reused across kv_bits. It batches
    (max_concurrency > 1: each row of mlxd's batch keeps its own quantised cache; a model whose rows cannot be
    decoded apart, such as DeepSeek's latent attention, is served one request at a time, and /health says why) and
    needs no rank group; vision models and layers mlx-lm cannot quantise (rotating windows, recurrent state) keep the model's dtype, and the engine's log says so. Every
    request's KV is allocated once, at the length its admission counted (prompt + max_tokens), so memory does not
    grow while it generates."""

    host: str = Field(default="127.0.0.1", description=(
        "The engine's bind address. Every request but `GET /livez` must carry the key in `$MLXD_HOME/engine.key` "
        "(made at first start, 0600; the gateway, the crash listener and the CLI send it; `mlxd key rotate` "
        "renews it), on loopback too: containers, other users and web pages reach loopback ports."))
    require_key: Literal[True] = Field(default=True, description=(
        "Always true: the engine's port requires its key (kept so that configs that set it still load)."))
    port: int = Field(default=8080, ge=1, le=65535, description="The engine's port.")
    allowed_hosts: list[str] = Field(default_factory=list, description=(
        "Names the engine answers to beyond its built-in ones (a DNS-rebinding guard: any IP address, "
        "`localhost`, `host.docker.internal` and this machine's own names always pass); `[\"*\"]`: any name."))
    default_model: str = Field(default="default", description="The alias or model id preloaded at start.")
    max_concurrency: int = Field(default=1, ge=1, le=64, description=(
        "Requests generated at once. 1 is single concurrency: one request holds the model, the rest wait in line. "
        "Above 1 the running requests are decoded as one batch (above: when it is safe)."))
    batching: Literal["auto", "always"] = Field(default="auto", description=(
        "With `max_concurrency` above 1: `auto` times a step of several rows against one row's at each model's "
        "load (plain and verify-shaped steps) and serves one request at a time where the batch decodes fewer "
        "tokens a second, and always on the CPU (each row costs a step of its own there: batched agents were "
        "measured slower in every run); /health's `serving.reason` says so. `always` batches regardless (each "
        "agent's first token sooner, the whole job slower where `auto` would not batch)."))
    attention_shapes: Literal["auto", "few", "any"] = Field(default="auto", description=(
        "`few`: requests' KV buffers in coarse steps (an eighth of an octave: up to 12.5 % more KV memory) and "
        "joining prompts' chunks widened to whole steps of 256 tokens (cached tokens run again, padding after), so "
        "that attention meets few shapes: MLX's CUDA backend builds a cuDNN graph for each new one (70-150 ms, every "
        "request waiting). `any`: buffers in steps of 256, chunks as they come. `auto`: `few` on MLX's CUDA "
        "backend, `any` elsewhere."))
    max_queue: int = Field(default=8, ge=0, description=(
        "Requests that may wait beyond the running ones; the next is answered 429 (busy)."))
    queue_timeout_s: float = Field(default=120.0, gt=0, description=(
        "The longest a request waits in line for the worker."))
    request_deadline_s: float = Field(default=600.0, gt=0, description="The wall-clock limit of one generation.")
    max_prompt_tokens: int = Field(default=32768, gt=0, description=(
        "The longest prompt, in tokens; a longer one is refused (`context_length_exceeded`)."))
    context_overflow: ContextOverflow = Field(default="error", description=(
        "A conversation longer than the model's context: `\"error\"` answers 400 `context_length_exceeded` (the "
        "gateway may send it to the Ollama fallback); `\"truncate_middle\"` keeps the system prompt, the tools and "
        "the newest turn and drops whole older turns (a user message and all that answered it, tool calls with "
        "their results), oldest first, until it fits with room for the answer, and says so: the answer's "
        "`X-Mlxd-Context-Truncated` header and `dropped_prompt_tokens` in its usage (`dropped_input_tokens` on the "
        "Responses and Messages APIs). Per model: "
        "`[models.ID] context_overflow`."))
    max_tokens_cap: int = Field(default=8192, gt=0, description="The ceiling on a request's `max_tokens`.")
    default_max_tokens: int = Field(default=1024, gt=0, description="`max_tokens` where a request gives none.")
    memory_fraction: float = Field(default=0.75, gt=0, le=1.0, description=(
        "The memory budget: this share of the GPU's memory (Metal's working set, CUDA's device memory), else of "
        "physical memory. A model whose estimate does not fit is heavy: Ollama serves it."))
    context_tokens: int = Field(default=8192, gt=0, description=(
        "The KV allowance in a model's memory estimate: the model must fit with KV for this many tokens."))
    heavy_patterns: list[str] = Field(
        default_factory=lambda: ["70b", "72b", "90b", "104b", "110b", "123b", "235b", "405b", "480b", "671b"],
        description="Name fragments that make a model heavy when its size cannot be read (no weights or config).")
    shutdown_grace_s: float = Field(default=10.0, ge=0, description=(
        "On stop, running requests get this long to finish before they are cancelled."))
    stuck_grace_s: float = Field(default=30.0, gt=0, description=(
        "A running request that makes no progress (no prefill step, no token) this long makes the engine stuck: "
        "unhealthy, so the supervisor restarts it."))
    prefill_step_size: int | None = Field(default=None, ge=16, description=(
        "The most prompt tokens per prefill step; unset: 512, and 2048 (mlx-lm's own default) on MLX's CUDA backend, "
        "where each step's attention shape costs a graph of its own. With requests decoding, the joining "
        "prompts' chunks of a step share it, run in the decoding rows' forward. Every step is a heartbeat of the "
        "stuck detection, so steps are sized from the measured speed to take well under `stuck_grace_s` on a slow "
        "machine with a big model, never more than this. Larger: joining prompts prefill faster on a GPU, the "
        "decoding requests' tokens come slower while they do."))
    cpu_float32: bool = Field(default=True, description=(
        "On the CPU backend with an optimised BLAS (Linux: engine/cpu/fast_blas.py), load models whose float32 weights "
        "take at most a quarter of the memory budget as float32: there a prompt runs ~15x faster than quantised."))
    speculative: Speculative = Field(default="prompt_lookup", description=(
        "Speculative decoding of each request, alone or in a batch: `prompt_lookup` proposes the tokens that "
        "followed the "
        "answer's last few tokens earlier in the prompt or the answer (an agent's edit re-emitting a file, a tool "
        "call repeating a path) and verifies them in one forward; greedy answers stay token for token the same, "
        "sampled ones are drawn from the same distribution (the speculative acceptance rule). "
        "It proposes only where its measured acceptance and verify cost beat a plain step, so where nothing can be "
        "copied, or a verify costs several steps (a CPU), it decodes as `off` does; it learns where copying pays from "
        "every token, proposed or not. A model with a `draft` model is decoded by its draft instead. `off`: one "
        "token per forward (engine/model/speculative.py, engine/model/draft_model.py)."))
    keep_alive: str | int | float = Field(default="5m", description=(
        "How long the model stays loaded with no request: after it the model, its KV and MLX's buffer cache are "
        "given back and the next request loads it again (its conversations stay warm in the prompt cache's disk "
        "tier). A duration as Ollama writes one (`\"5m\"`, `\"1h\"`, `\"90s\"`, seconds as a number); `0` "
        "unloads after every request, a negative one never. A request's own `keep_alive` sets it for after that "
        "request. 5 minutes, as Ollama: an agent's turns come seconds apart, so a session keeps its model, while "
        "memory comes back minutes after the work stops; the reload costs the weights' read (seconds) and no "
        "conversation's prefill. Health probes are not requests."))
    stored_responses_ttl: str | int | float = Field(default="720h", description=(
        "How long a stored Responses API answer (and its conversation, for `previous_response_id`) is kept: a "
        "duration as `keep_alive` takes one; 720h (30 days) is OpenAI's; a negative one never expires them. Each "
        "belongs to the key that made it (the gateway passes a hash of the caller's key): any other caller gets "
        "404, as for an unknown id. `DELETE /v1/responses/{id}` removes one sooner; the latest 1,000 (256 MiB) "
        "are kept at most."))
    kv_bits: KVBits = Field(default=16, description=(
        "The KV cache's precision: 16 keeps the model's dtype; 8 or 4 store keys and values quantised (above). "
        "Batches as the model's dtype does (`max_concurrency`)."))
    kv_group_size: KVGroupSize = Field(default=64, description=(
        "Values per scale and bias in a quantised KV cache (a smaller size where a model's head is not a "
        "multiple)."))
    quantized_kv_start: int = Field(default=0, ge=0, description=(
        "The position in a request from which its KV is stored quantised (with `kv_bits` below 16)."))
    log_level: Literal["debug", "info", "warning"] = Field(default="info", description=(
        "The engine's own log: `\"debug\"` adds, per request, the text on both sides of where prompt-cache reuse "
        "stopped (which agent field broke it)."))
    strip_metadata: list[Literal["claude_code_billing_header"]] = Field(
        default_factory=lambda: ["claude_code_billing_header"], description=(
            "Per-request metadata that agents write into the prompt for a hosted API's own servers, removed before "
            "the chat template (engine/api/request_metadata.py). `claude_code_billing_header` is the "
            "`x-anthropic-billing-header: cc_version=...; cch=...;` line Claude Code puts at the top of its system "
            "prompt for Anthropic's billing, which changes every request and would otherwise defeat the prompt "
            "cache; `[]` keeps prompts exactly as sent."))
    prompt_cache: PromptCacheConfig = PromptCacheConfig()
    images: ImagesConfig = ImagesConfig()
    ranks: RanksConfig = RanksConfig()

    @field_validator("keep_alive", "stored_responses_ttl")
    @classmethod
    def _a_duration(cls, v: str | int | float) -> str | int | float:
        parse_duration(v)  # ValueError names what it takes
        return v

