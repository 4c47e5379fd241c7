"""An HTTP request turned into a job for the worker (engine/model/job.py).

`job_from_request` validates what can be judged without the tokenizer (the
model, a certainly-too-long prompt, the images' bytes); the worker checks the
rest.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from mlxd.config import EngineConfig
from mlxd.durations import parse_duration

from ..cache.cache_keys import conversation_keys
from ..model.errors import EngineError, bad_request
from ..model.events import EventChannel
from ..model.grammar import OutputRules
from ..model.job import Job, SamplingParams
from ..model.model_registry import ModelRegistry
from .images import ImagePolicy, check_image, read_image_bytes
from .request_metadata import without_metadata
from .request_schema import ChatCompletionRequest, SamplingFields

MAX_CHARS_PER_TOKEN = 64  # generous: tokens of real vocabularies span far fewer characters


def job_from_request(req: SamplingFields, kind: str, registry: ModelRegistry, limits: EngineConfig) -> Job:
    """The job for a validated request; raises the EngineError that refuses it."""
    model_id = registry.resolve(req.model)
    messages = tools = prompt = None
    template_kwargs: dict[str, Any] = {}
    images: tuple[bytes, ...] = ()
    rules = OutputRules()
    if isinstance(req, ChatCompletionRequest):
        messages = [m.for_template() for m in without_metadata(req.messages, limits.strip_metadata)]
        tools = req.tools_for_template()
        template_kwargs = req.template_kwargs()
        rules = req.output_rules()
        if req.image_parts():  # the policy resolves its folders on disk: only for requests with images
            images = read_images(req, ImagePolicy.from_config(limits.images))
    else:
        prompt = req.prompt  # type: ignore[attr-defined]
    check_prompt_size(messages, tools, prompt, limits.max_prompt_tokens)
    registry.check_allowed(model_id)
    if images and registry.is_vision(model_id) is False:  # None: not known before the load; the worker checks
        raise EngineError(400, f"the model {req.model!r} is a text model and cannot see images; send the request "
                               "to a vision model, or without image_url parts", code="images_not_supported",
                          param="messages")
    requested = req.requested_max_tokens() or limits.default_max_tokens
    params = SamplingParams(
        max_tokens=min(requested, limits.max_tokens_cap),
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
        stop=tuple(req.stop), presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
    )
    return Job(id=uuid.uuid4().hex[:12], kind=kind, model_id=model_id, params=params,
               channel=EventChannel(asyncio.get_running_loop()), deadline_s=limits.request_deadline_s,
               messages=messages, tools=tools, prompt=prompt, template_kwargs=template_kwargs, images=images,
               rules=rules, conversation=conversation_keys(messages, tools, limits.prompt_cache.normalize),
               context_overflow=registry.context_overflow(model_id),
               keep_alive_s=parse_duration(req.keep_alive) if req.keep_alive is not None else None)


def read_images(req: ChatCompletionRequest, policy: ImagePolicy) -> tuple[bytes, ...]:
    """The request's images, encoded, each read and checked to be an image
    (engine/api/images.py); the 400 that refuses them otherwise."""
    parts = req.image_parts()
    if len(parts) > policy.max_images:
        raise bad_request(f"the request has {len(parts)} images, over this engine's limit of {policy.max_images}",
                          param="messages")
    images = []
    for where, url in parts:
        data = read_image_bytes(url, policy, where)
        check_image(data, policy, where)
        images.append(data)
    return tuple(images)


def check_prompt_size(messages: list[dict] | None, tools: list[dict] | None, prompt: str | list[int] | None,
                      max_prompt_tokens: int) -> None:
    """Refuse a prompt that cannot fit before the worker tokenizes it: no
    token of a real tokenizer spans more than MAX_CHARS_PER_TOKEN
    characters, so a longer text is certainly over the limit (and
    tokenizing megabytes would stall the worker)."""
    if messages is not None:
        # Everything the chat template renders counts: names, tool calls and
        # tool schemas too, not only the content (fuzzing found a huge `name`
        # that stalled the tokenizer long enough to count as a hang).
        chars = len(json.dumps([messages, tools], ensure_ascii=False, default=str))
    else:
        chars = len(prompt) if isinstance(prompt, str) else 0  # token ids: the worker counts them exactly
    if chars > max_prompt_tokens * MAX_CHARS_PER_TOKEN:
        raise EngineError(400, f"the prompt has {chars} characters, certainly over this engine's limit of "
                               f"{max_prompt_tokens} tokens", code="context_length_exceeded", param="messages")
