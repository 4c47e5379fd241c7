"""One job's generation on the resident model: its prompt tokenized, its
tokens relayed.

Runs on the worker thread (every MLX call does). A `Generation` turns a
decoder's tokens (engine/model/decoding.py) into the job's events: stop strings
held back until decided, tool calls split out, a slow reader pushing back.
The core owns the model, its status and its counters; a Generation owns
only its job's answer.
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mlxd.api_errors import INVALID_MESSAGES, UNSUPPORTED_PARAMETER
from mlxd.memory_estimate import KVLayout

from .errors import EngineError, bad_request
from .events import Delta, Failed, Finished, ToolCalls
from .faults import FaultInjector
from .job import Job
from .prefill import cancelled_error
from .prompt_tokens import PieceEncoder, template_tokens
from .stop_matcher import StopMatcher
from .answer_parts import AnswerSplitter, Markers, Part, closes_reasoning, markers_of, opens_in_reasoning
from .answer_grammar import answer_grammar, reasoning_budget
from .grammar import GrammarUnsupported, grammar_problem
from .tool_calls import format_tool_calls, model_parser
from .tool_formats import MLXD_TOOL_FORMAT, ToolFormat
from .tool_prompt import with_rendered_tools
from .context_overflow import Truncation, answer_room, fewest_turns_to_drop, turns, without_oldest

# Prompt tokens looked at for an open reasoning block (the template opens it
# at the very end of the prompt).
PROMPT_TAIL = 64

log = logging.getLogger("mlxd.engine.core.worker")  # it runs on the worker thread, and logs as the worker
MAX_BACKLOG = 2048  # events buffered for a slow reader before the worker waits


@dataclass(frozen=True)
class ResidentModel:
    """The one loaded model: mlx-lm's model and tokenizer, or, for a vision
    model, mlx-vlm's model and processor (with mlx-lm's tokenizer wrapper on
    the same files, for the reasoning and tool-call markers)."""

    model_id: str
    model: Any
    tokenizer: Any
    encoder: PieceEncoder | None = None  # chat prompts, piece by piece (engine/model/prompt_tokens.py)
    processor: Any = None  # mlx-vlm's processor; None for a text model
    kv: KVLayout = KVLayout()  # how its requests' KV holds values (kv_bits)
    # Decode over quantised KV dequantised (engine/cache/kv_cache.py): MLX has no kernel for mlx-lm's way here.
    dequantized_decode: bool = False
    # Whether the chat template renders a request's tools; where it does not, mlxd does (engine/model/tool_prompt.py).
    renders_tools: bool = True
    tool_format: ToolFormat | None = None  # the tool-call format a grammar can bind (engine/model/tool_formats.py)
    # The longest sequence the model was made for (its config's max_position_embeddings); None: not known.
    context_tokens: int | None = None
    # The worker's per-model caches (llguidance's tokenizer): built on first use, on the worker thread.
    built: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def vision(self) -> bool:
        return self.processor is not None

    def vocab_size(self) -> int:
        args = getattr(self.model, "args", None)
        return int(getattr(args, "vocab_size", 0) or len(self.tokenizer.vocab))

    @property
    def tools_by(self) -> str:
        """Who renders a request's tools into the prompt: "template" or "mlxd"."""
        return "template" if self.renders_tools else "mlxd"

    def tool_parser(self) -> Callable[[str, Any], Any]:
        if not self.renders_tools:
            from mlx_lm.tool_parsers.json_tools import parse_tool_call

            return parse_tool_call
        return model_parser(self.tokenizer)  # type: ignore[return-value]

    def grammar_tokenizer(self) -> Any:
        if "grammar_tokenizer" not in self.built:
            from .constrained import grammar_tokenizer

            self.built["grammar_tokenizer"] = grammar_tokenizer(self.tokenizer, self.vocab_size())
        return self.built["grammar_tokenizer"]


@dataclass(frozen=True)
class VisionPrompt:
    """A vision model's prompt, prepared once by mlx-vlm's processor: the
    token ids (each image widened to its image tokens) and the tensors the
    model takes with them."""

    tokens: list[int]
    inputs: dict[str, Any]  # input_ids, pixel_values, mask and the model's extras (image_grid_thw...)
    image_tokens: int


def finish_reason(stopped: bool, model_finish: str | None, cancelled: bool, past_deadline: bool) -> str | None:
    """Why decoding ends after this token, or None to go on (pure; the
    first that holds wins). "deadline" and "cancelled" are ours, not OpenAI's."""
    if stopped:
        return "stop"
    if model_finish is not None:
        return model_finish
    if cancelled:
        return "cancelled"
    if past_deadline:
        return "deadline"
    return None


def answer_finish(finish: str, called_tools: bool) -> str:
    """The finish_reason the answer reports (pure): a model that stopped
    after calling tools finished with "tool_calls"."""
    return "tool_calls" if called_tools and finish == "stop" else finish


def tokenize(resident: ResidentModel, job: Job, max_prompt_tokens: int) -> tuple[list[int], Truncation | None]:
    """The job's prompt as token ids, and what truncate_middle dropped of it
    (None: nothing); raises the 400 for a prompt the model cannot take."""
    if job.images:
        raise EngineError(400, f"the model {job.model_id!r} is a text model and cannot see images; send the "
                               "request to a vision model, or without image_url parts",
                          code="images_not_supported", param="messages")
    tok = resident.tokenizer
    truncation = None
    if job.kind == "completion":
        if isinstance(job.prompt, list):
            _check_token_ids(job.prompt, resident.vocab_size(), "prompt")
            tokens = list(job.prompt)
        else:
            tokens = tok.encode(job.prompt)
    elif getattr(tok, "chat_template", None):
        messages, tools = job.messages or [], job.tools
        if not resident.renders_tools:  # the template would drop them silently: mlxd writes them in
            messages, tools = with_rendered_tools(messages, tools), None
        tokens = _chat_tokens(resident, job, messages, tools)
        if job.context_overflow == "truncate_middle" and _over(tokens, resident, max_prompt_tokens):
            tokens, truncation = _truncate_middle(resident, job, messages, tools, tokens, max_prompt_tokens)
    else:
        from mlx_lm.server import convert_chat

        tokens = tok.encode(convert_chat(job.messages))
    if not tokens:
        raise bad_request("the prompt is empty", param="prompt")
    if len(tokens) > max_prompt_tokens:
        raise EngineError(400, f"the prompt has {len(tokens)} tokens, over this engine's limit of "
                               f"{max_prompt_tokens}", code="context_length_exceeded", param="messages")
    if resident.context_tokens and len(tokens) >= resident.context_tokens:
        # past its context a model reads garbage, slowly; the gateway's fallback may hold a longer one
        raise EngineError(400, f"the prompt has {len(tokens)} tokens, over the context of the model "
                               f"{job.model_id!r} ({resident.context_tokens} tokens)", code="context_length_exceeded",
                          param="messages")
    if job.params.logit_bias:
        _check_token_ids(job.params.logit_bias, resident.vocab_size(), "logit_bias")
    if job.rules.constrained:  # each part was checked with the request; the whole, here, before decoding needs it
        lark = bound_grammar(resident, job, tokens[-PROMPT_TAIL:])
        problem = grammar_problem(lark) if lark else None
        if problem:
            raise bad_request(f"the answer's grammar cannot be enforced for this model: {problem}",
                              param="response_format" if job.rules.schema is not None else "tool_choice",
                              code=UNSUPPORTED_PARAMETER)
    return tokens, truncation


def _chat_tokens(resident: ResidentModel, job: Job, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The chat template's tokens for these messages; the 400 where it rejects them."""
    tok = resident.tokenizer
    try:
        if resident.encoder is not None and resident.encoder.enabled:
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                           tokenize=False, **job.template_kwargs)
            return resident.encoder.encode(text)
        return template_tokens(tok, messages, tools, **job.template_kwargs)
    except Exception as exc:  # noqa: BLE001 - templates raise anything; it is the input's fault
        raise bad_request(f"the model's chat template rejected the messages: {exc}", param="messages",
                          code=INVALID_MESSAGES) from exc


def _over(tokens: list[int], resident: ResidentModel, max_prompt_tokens: int) -> bool:
    return len(tokens) > max_prompt_tokens or bool(resident.context_tokens and len(tokens) >= resident.context_tokens)


def _truncate_middle(resident: ResidentModel, job: Job, messages: list[dict], tools: list[dict] | None,
                     tokens: list[int], max_prompt_tokens: int) -> tuple[list[int], Truncation | None]:
    """The prompt with the fewest oldest turns dropped that fits the model's
    context with room for the answer (engine/model/context_overflow.py); as
    it was (and so the 400 after) when even the newest turn alone does not."""
    context = min(max_prompt_tokens + 1, resident.context_tokens or max_prompt_tokens + 1)
    limit = context - 1 - answer_room(context, job.params.max_tokens)
    groups = turns(messages)
    rendered: dict[int, list[int]] = {0: tokens}

    def count(k: int) -> int:
        if k not in rendered:
            rendered[k] = _chat_tokens(resident, job, without_oldest(messages, groups, k), tools)
        return len(rendered[k])

    k = fewest_turns_to_drop(count, len(groups), limit)
    if k is None:
        return tokens, None
    kept = rendered[k]
    truncation = Truncation(len(tokens) - len(kept), sum(len(g) for g in groups[:k]), len(kept),
                            resident.context_tokens)
    log.info("request %s: %s", job.id, truncation.header())
    return kept, truncation


def bound_grammar(resident: ResidentModel, job: Job, prompt_tail: list[int]) -> str | None:
    """The Lark grammar the job's answer must follow on this model (engine/model/grammar.py),
    or None: in the model's tool-call format, after its reasoning where it reasons
    (opened by the prompt's tail, or by the model); markers that are special
    tokens named by id. A 400 where the model's call format cannot be bound."""
    markers = markers_of(resident.tokenizer, False)
    think = markers.think
    tail = prompt_tail[-PROMPT_TAIL:]
    in_reasoning = think is not None and opens_in_reasoning(resident.tokenizer, tail)
    if think is not None and closes_reasoning(resident.tokenizer, tail):
        think = None  # thinking turned off by the template: the bound answer starts with its body
    from .constrained import marker_literal

    literal = marker_literal(resident.grammar_tokenizer(), getattr(resident.tokenizer, "_tokenizer", resident.tokenizer))
    try:
        return answer_grammar(job.rules, resident.tool_format, think[1] if think else None, in_reasoning,
                              think[0] if think else None, literal, reasoning_budget(job.params.max_tokens))
    except GrammarUnsupported as exc:
        raise bad_request(f"tool_choice / strict tools: {exc}", param="tool_choice",
                          code=UNSUPPORTED_PARAMETER) from exc


def vision_prompt(resident: ResidentModel, job: Job, max_prompt_tokens: int) -> VisionPrompt:
    """A vision model's prompt: mlx-vlm's chat template for the model type
    (which places each image's placeholder) and its processor (which widens
    them to the image's tokens); the 400 for a prompt the model cannot take."""
    from mlx_vlm import apply_chat_template
    from mlx_vlm.generate.dispatch import should_add_special_tokens
    from mlx_vlm.utils import load_image, prepare_inputs

    if job.kind != "chat":
        raise bad_request("this is a vision model: use /v1/chat/completions", code=UNSUPPORTED_PARAMETER)
    config = resident.model.config
    try:
        text = apply_chat_template(resident.processor, config, job.messages, num_images=len(job.images),
                                   tools=job.tools, **job.template_kwargs)
    except Exception as exc:  # noqa: BLE001 - templates raise anything; it is the input's fault
        raise bad_request(f"the model's chat template rejected the messages: {exc}", param="messages",
                          code=INVALID_MESSAGES) from exc
    try:
        images = [load_image(io.BytesIO(data)) for data in job.images]  # RGB, upright (EXIF), as mlx-vlm loads one
    except Exception as exc:  # noqa: BLE001 - a truncated or odd file: the input's fault
        raise bad_request(f"an image could not be decoded: {exc}", param="messages") from exc
    try:
        inputs = prepare_inputs(resident.processor, images=images or None, prompts=text,
                                image_token_index=getattr(config, "image_token_index", None),
                                add_special_tokens=should_add_special_tokens(config.model_type, resident.processor))
    except (ValueError, TypeError, KeyError, IndexError) as exc:  # the processor refused this input
        raise bad_request(f"the model's processor could not prepare the prompt: {exc}", param="messages") from exc
    tokens = inputs["input_ids"].flatten().tolist()
    image_id = getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)
    image_tokens = sum(1 for t in tokens if t == image_id) if images else 0
    if len(tokens) > max_prompt_tokens:
        raise EngineError(400, f"the prompt has {len(tokens)} tokens ({image_tokens} of them for images), over this "
                               f"engine's limit of {max_prompt_tokens}", code="context_length_exceeded",
                          param="messages")
    extras = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    return VisionPrompt(tokens, {"input_ids": inputs["input_ids"], "pixel_values": inputs.get("pixel_values"),
                                 "mask": inputs.get("attention_mask"), **extras}, image_tokens)


def _check_token_ids(ids: Any, vocab: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"{param} token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)


class Generation:
    """One job's answer as its tokens come from a decoder (engine/model/decoding.py):
    its events sent, its finish decided. `heartbeat` reports progress (the
    worker's stuck detection)."""

    def __init__(self, resident: ResidentModel, job: Job, faults: FaultInjector,
                 heartbeat: Callable[..., None]) -> None:
        self.resident = resident
        self.job = job
        self.faults = faults
        self.heartbeat = heartbeat
        self.stops = StopMatcher(list(job.params.stop))
        # A text completion is raw text: only chat answers are split; with
        # tool_choice "none" a call is not parsed (the grammar, where there is one, allows none).
        calls = bool(job.tools) and job.rules.tool_choice != "none"
        self.markers = markers_of(resident.tokenizer, calls) if job.kind == "chat" else Markers()
        if calls and not resident.renders_tools:  # mlxd's own format (engine/model/tool_prompt.py)
            self.markers = Markers(self.markers.think, (MLXD_TOOL_FORMAT.start, MLXD_TOOL_FORMAT.end))
        self.grammar: Any = None  # the answer's GrammarProcessor (engine/model/constrained.py), made in begin()
        self.splitter = AnswerSplitter(self.markers)  # replaced in decode, which sees the whole prompt
        self.called_tools = False
        self.deadline = time.monotonic() + job.deadline_s
        # A slow reader makes a lone generation wait; in a batch it would hold
        # every other request, so there its events queue up instead (at most
        # max_tokens of them).
        self.waits_for_reader = True
        self.tokens: list[int] = []  # generated so far (begin() starts the list)

    def begin(self, prompt_tail: list[int]) -> None:
        """Before the first token: whether the prompt leaves the model in its
        reasoning (the template opens it at the end of the prompt)."""
        self.tokens = []
        self._token_faults = (any(f.point == "token" for f in self.faults.active)
                              and self.faults.applies_to(self.job.text))
        if self.markers.think is not None:
            tail = prompt_tail[-PROMPT_TAIL:]
            self.splitter = AnswerSplitter(self.markers, opens_in_reasoning(self.resident.tokenizer, tail))
        self.grammar = self._grammar(prompt_tail) if self.job.rules.constrained else None

    def _grammar(self, prompt_tail: list[int]) -> Any:
        """The answer's grammar as a logits processor (bound_grammar; tokenize()
        checked it compiles, so this cannot fail on the input: if it did, the
        request gets a 400, never the engine an MLX error)."""
        from .constrained import GrammarProcessor

        resident = self.resident
        lark = bound_grammar(resident, self.job, prompt_tail)
        if lark is None:
            return None
        log.info("request %s: answer bound by a grammar (%s)", self.job.id, self.job.rules.describe())
        try:
            return GrammarProcessor(resident.grammar_tokenizer(), lark, resident.vocab_size(),
                                    sorted(resident.tokenizer.eos_token_ids))
        except ValueError as exc:
            raise bad_request(f"the answer's grammar cannot be enforced for this model: {exc}",
                              code=UNSUPPORTED_PARAMETER) from exc

    def feed(self, text: str, token: int | None, model_finish: str | None) -> str | None:
        """One generated token (None: mlx-vlm's closing step) and its text:
        relayed; the finish when decoding ends here, else None."""
        self.heartbeat()
        if token is None:  # mlx-vlm's closing step: the last text, no token
            self._relay(text)
            return finish_reason(self.stops.stopped, model_finish, False, False) or "length"
        self.tokens.append(token)
        if self._token_faults:
            self.faults.check("token", len(self.tokens))
        self._relay(text)
        finish = finish_reason(self.stops.stopped, model_finish, self.job.cancelled.is_set(),
                               time.monotonic() > self.deadline)
        if finish == "deadline":
            log.info("request %s hit its %.0fs deadline after %d tokens", self.job.id, self.job.deadline_s,
                     len(self.tokens))
            return "length"  # the deadline ends the answer like max_tokens does
        return finish

    def end(self, finish: str, prompt_tokens: int, generated: int, cached_tokens: int = 0) -> None:
        """Send what was held back and the last event."""
        channel = self.job.channel
        if finish == "cancelled":
            # Client gone, or the drain's grace ran out: never end such an
            # answer as if it were complete.
            channel.put(Failed(cancelled_error()))
            return
        self._send(self.splitter.feed(self.stops.flush()) + self.splitter.flush())
        channel.put(Finished(answer_finish(finish, self.called_tools), prompt_tokens, generated, cached_tokens,
                             self.stops.matched))

    def _relay(self, piece: str) -> None:
        self._send(self.splitter.feed(self.stops.feed(piece)))
        if self.waits_for_reader and self.job.channel.backlog > MAX_BACKLOG:
            self._wait_for_reader()

    def _send(self, parts: list[Part]) -> None:
        channel = self.job.channel
        for part in parts:
            if part.kind == "tool":
                calls, unparsed = format_tool_calls([part.text], self.resident.tool_parser(), self.job.tools)
                if calls:
                    channel.put(ToolCalls(calls))
                    self.called_tools = True
                if unparsed:  # nothing the model wrote is lost
                    channel.put(Delta(unparsed))
            else:
                channel.put(Delta(part.text, reasoning=part.kind == "reasoning"))

    def _wait_for_reader(self) -> None:
        """Backpressure: a client that reads slower than we generate makes
        the worker wait (bounded by the deadline) instead of buffering
        without limit."""
        job = self.job
        while (job.channel.backlog > MAX_BACKLOG // 2 and not job.cancelled.is_set()
               and time.monotonic() < self.deadline):
            self.heartbeat()  # waiting on a client is not being stuck
            time.sleep(0.005)
