"""vLLM's own OpenAI serving classes, built on the ingress for the app's model over the legs' engine client
(app/ingress/engine_client.py): the same request models, chat template and response builders as `vllm serve`."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config import ModelConfig, VllmConfig
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.renderers.online_renderer import OnlineRenderer

from app.config import EngineConfig
from app.ingress.engine_client import LegsEngineClient
from app.tiny_model import resolve_model_source

# The model's config keys that shape what the serving layer renders, checks and defaults (the rest, dtype
# included, are the engines' own: the ingress computes nothing).
MODEL_KEYS = ("max_model_len", "tokenizer", "tokenizer_mode", "trust_remote_code", "revision", "generation_config")


@dataclass
class Serving:
    client: LegsEngineClient
    models: OpenAIServingModels
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat


def build_serving(model_id: str, engine: EngineConfig) -> Serving:
    """vLLM's serving objects for the model the decode engines run, as `vllm serve` would build them."""
    path = resolve_model_source(engine.model_loading_config.model_source)
    model = {key: engine.engine_kwargs[key] for key in MODEL_KEYS if key in engine.engine_kwargs}
    client = LegsEngineClient(VllmConfig(model_config=ModelConfig(model=path, served_model_name=model_id, **model)))
    models = OpenAIServingModels(engine_client=client, base_model_paths=[BaseModelPath(name=model_id,
                                                                                      model_path=path)])
    renderer = OnlineRenderer(model_config=client.model_config, renderer=client.renderer, request_logger=None,
                              chat_template=None, chat_template_content_format="auto")
    return Serving(
        client, models,
        # usage tells the prompt tokens decode did not compute itself: those that came by transfer
        OpenAIServingCompletion(client, models, online_renderer=renderer, request_logger=None,
                                enable_prompt_tokens_details=True),
        OpenAIServingChat(client, models, "assistant", online_renderer=renderer, request_logger=None,
                          chat_template=None, chat_template_content_format="auto", enable_prompt_tokens_details=True))
