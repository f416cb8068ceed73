"""vLLM's own OpenAI serving classes, built on the ingress for the app's model over the legs' engine client
(app/ingress/engine_client.py): the same request models, chat template and response builders as `vllm serve`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm.config import ModelConfig, StructuredOutputsConfig, VllmConfig
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.renderers.chat_utils import load_chat_template
from vllm.renderers.online_renderer import OnlineRenderer

from app.config import ChatConfig, EngineConfig
from app.ingress.engine_client import LegsEngineClient
from app.tiny_model import resolve_model_source

ROOT = Path(__file__).resolve().parents[2]
# The model's config keys that shape what the serving layer renders, checks and defaults (the rest, dtype
# included, are the engines' own: the ingress computes nothing).
MODEL_KEYS = ("max_model_len", "tokenizer", "tokenizer_mode", "trust_remote_code", "revision", "generation_config")


@dataclass
class Serving:
    client: LegsEngineClient
    models: OpenAIServingModels
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat


def build_serving(model_id: str, engine: EngineConfig, chat: ChatConfig) -> Serving:
    """vLLM's serving objects for the model the decode engines run, as `vllm serve` would build them."""
    path = resolve_model_source(engine.model_loading_config.model_source)
    model = {key: engine.engine_kwargs[key] for key in MODEL_KEYS if key in engine.engine_kwargs}
    # The engines' structured outputs backend, which the ingress checks each request's grammar with.
    structured = StructuredOutputsConfig(**engine.engine_kwargs.get("structured_outputs_config", {}))
    client = LegsEngineClient(VllmConfig(model_config=ModelConfig(model=path, served_model_name=model_id, **model),
                                         structured_outputs_config=structured))
    models = OpenAIServingModels(engine_client=client, base_model_paths=[BaseModelPath(name=model_id,
                                                                                      model_path=path)])
    template = _chat_template(chat.chat_template)
    parsing = {"enable_auto_tools": chat.enable_auto_tool_choice, "tool_parser": chat.tool_call_parser,
               "reasoning_parser": chat.reasoning_parser or ""}  # the renderer checks a request's tool choice
    renderer = OnlineRenderer(model_config=client.model_config, renderer=client.renderer, request_logger=None,
                              chat_template=template, chat_template_content_format="auto", **parsing)
    return Serving(
        client, models,
        # usage tells the prompt tokens decode did not compute itself: those that came by transfer
        OpenAIServingCompletion(client, models, online_renderer=renderer, request_logger=None,
                                enable_prompt_tokens_details=True),
        OpenAIServingChat(client, models, "assistant", online_renderer=renderer, request_logger=None,
                          chat_template=template, chat_template_content_format="auto", **parsing,
                          enable_prompt_tokens_details=True))


def _chat_template(template: str | None) -> str | None:
    """The template itself, read from its file when given a path (relative paths from the project root)."""
    if template is None or "{" in template:  # none, or the template itself (Jinja)
        return template
    return load_chat_template(ROOT / template)  # an absolute path stays as it is
