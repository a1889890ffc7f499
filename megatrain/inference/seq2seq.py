"""Generation with an encoder-decoder (T5): encoder inputs in, decoder outputs out.

The inputs are right-padded into one batch and encoded once (padded keys hidden, so padding never
changes a result). The decoder starts from the decoder start token (Megatron's T5 decoder input
begins with the tokenizer's bos) and adds one token per step: its self-attention keys and values
accumulate in a :class:`KVCache`, and each layer's cross-attention keys and values are computed from
the encoder output on the first step and kept in the same cache. Greedy decoding or sampling
(temperature, top-k, top-p, a seed), as :func:`megatrain.inference.generation.generate`, whose
arguments and stopping rules this follows; tokens are chosen among the first ``vocab_size`` ids (the
tokenizer's: the embedding's padding rows are never produced).

Encoder inputs are tokenized with :func:`tokenize_with_sentinels` (a literal ``<extra_id_i>`` is that
sentinel). A model qualifies by having ``is_encoder_decoder`` set and ``encode(tokens, padding_mask)``,
``decode_step(tokens, encoder_output, padding_mask, kv_cache)`` and ``logits(hidden)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from megatrain.data.seq2seq_dataset import tokenize_with_sentinels
from megatrain.inference.generation import _check_arguments, sample_next_tokens
from megatrain.models.common.attention import KVCache

__all__ = ["is_encoder_decoder", "decoder_start_token", "end_token", "generate_seq2seq", "tokenize_with_sentinels",
           "sequence_logprobs"]


def is_encoder_decoder(model: Any) -> bool:
    """Whether ``model`` generates from encoder inputs (T5) rather than continuing a prompt (GPT)."""
    return bool(getattr(model, "is_encoder_decoder", False))


def decoder_start_token(tokenizer: Any) -> int:
    """The decoder's first input: the tokenizer's bos (Megatron's T5 samples; [CLS] for WordPiece)."""
    bos = getattr(tokenizer, "bos", None)
    if bos is None:
        name = getattr(tokenizer, "name", "") or type(tokenizer).__name__
        raise ValueError(f"--tokenizer-type {name} has no bos token: a T5 decoder starts with it (Megatron's T5 "
                         "samples), e.g. [CLS] of BertWordPieceLowerCase")
    return int(bos)


def end_token(tokenizer: Any) -> int | None:
    """The token a T5 target ends with: the tokenizer's eos ([SEP] for WordPiece), else its eod."""
    eos = getattr(tokenizer, "eos", None)
    return int(eos) if eos is not None else getattr(tokenizer, "eod", None)


def _encoder_batch(encoder_ids: Sequence[Sequence[int]], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-padded encoder tokens [b, s] and their padding mask (None when nothing is padded)."""
    longest = max(len(ids) for ids in encoder_ids)
    tokens = torch.zeros(len(encoder_ids), longest, dtype=torch.long, device=device)
    real = torch.zeros(len(encoder_ids), longest, dtype=torch.bool, device=device)
    for i, ids in enumerate(encoder_ids):
        tokens[i, :len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        real[i, :len(ids)] = True
    return tokens, (None if bool(real.all()) else real)


def _check_lengths(model: nn.Module, encoder_ids: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    config = getattr(model, "config", None)
    if config is None or config.position_embedding_type != "learned_absolute":
        return
    longest = max(len(ids) for ids in encoder_ids)
    if longest > config.max_position_embeddings:
        raise ValueError(f"encoder input of {longest} tokens is longer than --max-position-embeddings "
                         f"({config.max_position_embeddings})")
    if max_new_tokens > config.max_position_embeddings:  # the decoder start and all but the last new token
        raise ValueError(f"{max_new_tokens} new tokens need as many decoder positions; --max-position-embeddings "
                         f"is {config.max_position_embeddings}")


def generate_seq2seq(
    model: nn.Module,
    encoder_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    decoder_start: int,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 0.0,
    eod: int | None = None,
    stop_token_sequences: Sequence[Sequence[int]] | None = None,
    seed: int | None = None,
    vocab_size: int | None = None,
    on_tokens: Callable[[list[int | None]], None] | None = None,
) -> list[list[int]]:
    """Decode up to ``max_new_tokens`` tokens for each encoder input; return the new tokens (the
    decoder start token not included; a stop token kept at the end, as ``generate`` does)."""
    _check_arguments(encoder_ids, max_new_tokens, greedy, temperature, top_k, top_p)
    _check_lengths(model, encoder_ids, max_new_tokens)
    stop_sequences = [list(seq) for seq in (stop_token_sequences or []) if len(seq) > 0]
    if eod is not None:
        stop_sequences.append([eod])
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            tokens, padding = _encoder_batch(encoder_ids, device)
            encoder_output = model.encode(tokens, padding)
            cache = KVCache(max_length=max_new_tokens)
            batch = len(encoder_ids)
            next_tokens = torch.full((batch,), decoder_start, dtype=torch.long, device=device)
            outputs: list[list[int]] = [[] for _ in range(batch)]
            finished = [False] * batch
            for step in range(max_new_tokens):
                hidden = model.decode_step(next_tokens[:, None], encoder_output, padding, cache)
                logits = model.logits(hidden[:, -1])
                if vocab_size is not None:
                    logits = logits[:, :vocab_size]
                next_tokens = sample_next_tokens(logits, greedy, temperature, top_k, top_p, generator)
                added: list[int | None] = [None] * batch
                for i, token in enumerate(next_tokens.tolist()):
                    if not finished[i]:
                        outputs[i].append(token)
                        added[i] = token
                        finished[i] = any(outputs[i][-len(seq):] == seq for seq in stop_sequences)
                if on_tokens is not None:
                    on_tokens(added)
                if all(finished):
                    break
            return outputs
    finally:
        model.train(was_training)


def sequence_logprobs(model: nn.Module, encoder_ids: Sequence[int], decoder_ids: Sequence[int],
                      decoder_start: int, vocab_size: int | None = None) -> list[float]:
    """The log-probability of each of ``decoder_ids`` given the encoder input and the tokens before it
    (teacher forcing from the decoder start token), over the first ``vocab_size`` ids."""
    if not decoder_ids:
        return []
    device = next(model.parameters()).device
    enc = torch.tensor([list(encoder_ids)], dtype=torch.long, device=device)
    dec = torch.tensor([[decoder_start, *decoder_ids[:-1]]], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = model(enc, dec)[..., :vocab_size].float().log_softmax(-1)[0]
    target = torch.tensor(list(decoder_ids), device=device)
    return logits.gather(-1, target[:, None])[:, 0].tolist()
