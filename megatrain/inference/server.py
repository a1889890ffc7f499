"""The text-generation server (``tools/run_text_generation_server.py``): its interface and its parts.

Endpoints (see docs/generate.md): Megatron-LM's ``PUT /api`` (:mod:`.megatron_api`), OpenAI's
``POST /v1/completions`` and ``GET /v1/models`` (:mod:`.openai_api`), ``POST /v1/chat/completions``
(:mod:`.chat`), ``GET /health``. The HTTP layer is FastAPI on uvicorn (:mod:`.server_app`); requests
become jobs of the generation engine (:mod:`megatrain.inference.engine`: continuous batching, each job
its own sampling), fed back to each request through its own queue (:mod:`.server_common`); prompt
scoring, beam search and encoder-decoder generation are registered engine calls (:mod:`.model_calls`).
A vision-language (LLaVA) model: the engine batches text-only requests on its language model; requests
with images run through a registered call (:mod:`.vision`, :mod:`.vision_requests`), one at a time.

Under tensor parallelism every rank builds the engine and registers the calls; rank 0 serves HTTP and
the others run ``engine.follow()`` (an encoder-decoder's :class:`CallOnlyEngine` too: its calls run on
every rank's shard).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from megatrain.inference.engine.api import Engine
from megatrain.inference.model_calls import CallOnlyEngine, register_model_calls
from megatrain.inference.seq2seq import is_encoder_decoder
from megatrain.inference.server_app import TextGenerationServer, build_app
from megatrain.inference.server_common import RequestError, ServerContext, ServerLimits, parse_request_body
from megatrain.inference.vision import ImagePrompts, image_processor_for, is_vision_model, register_vision_call

__all__ = ["RequestError", "ServerContext", "ServerLimits", "TextGenerationServer", "build_app", "build_engine",
           "make_context", "make_server", "model_context", "parse_request_body"]


def build_engine(model: nn.Module, max_requests: int = 16, max_sequence_length: int | None = None,
                 group: Any = None, max_waiting: int = 256, compile_forwards: bool = False) -> Engine:
    """The engine for ``model`` with the server's calls registered (on every rank): the batching
    engine for a decoder-only model (``max_requests`` sequences decoding at once, each of at most
    ``max_sequence_length`` tokens; ``group``: the tensor-parallel process group), :class:`CallOnlyEngine`
    for an encoder-decoder (T5: registered calls only, broadcast to the ``group``'s ranks as the batching
    engine's are). A vision-language model's engine runs its language model, and its image generation is
    a registered call. ``compile_forwards``: the engine's decode and prefill
    forwards through torch.compile."""
    vision_model = model if is_vision_model(model) else None
    if vision_model is not None:
        model = vision_model.language_model
    if max_sequence_length is None:  # the cache holds max_requests x this many tokens per layer
        max_sequence_length = min(model.config.max_position_embeddings, 4096)
    if is_encoder_decoder(model):
        engine: Any = CallOnlyEngine(model, None, group=group)
    else:
        from megatrain.inference.engine.engine import EngineConfig, GenerationEngine

        engine = GenerationEngine(model, EngineConfig(max_requests=max_requests,
                                                      max_sequence_length=max_sequence_length,
                                                      max_waiting=max_waiting, capture_graphs_at_start=True,
                                                      compile_decode=compile_forwards,
                                                      compile_prefill=compile_forwards), group=group)
    register_model_calls(engine)
    if vision_model is not None:
        register_vision_call(engine, vision_model)
    return engine


def make_context(engine: Engine, model: nn.Module, tokenizer: Any, limits: ServerLimits | None = None,
                 model_name: str = "megatrain", log_requests: bool = False,
                 saved_args: dict[str, Any] | None = None) -> ServerContext:
    """``saved_args``: the checkpoint's run arguments (a vision model's ``--image-processor``)."""
    vision = None
    config = getattr(model, "config", None)
    if is_vision_model(model):
        vision = ImagePrompts(model, tokenizer, image_processor_for(model, saved_args))
        config = model.config.language
    learned = config is not None and config.position_embedding_type == "learned_absolute"
    return ServerContext(engine, tokenizer, limits or ServerLimits(), model_name, is_encoder_decoder(model),
                         config.max_position_embeddings if learned else None, log_requests, vision)


def model_context(model: nn.Module, tokenizer: Any, limits: ServerLimits | None = None,
                  model_name: str = "megatrain", max_requests: int = 16) -> ServerContext:
    """One process serving ``model``: its engine (calls registered) and the context around it."""
    limits = limits or ServerLimits()
    return make_context(build_engine(model, max_requests=max_requests), model, tokenizer, limits, model_name)


TextGenerationService = model_context  # the name of the server's former service object


def make_server(ctx: ServerContext, host: str = "127.0.0.1", port: int = 5000,
                quiet: bool = False) -> TextGenerationServer:
    """A bound (not yet serving) server for ``ctx``; port 0 picks a free one (``server.port``)."""
    return TextGenerationServer(ctx, host, port, quiet)
