"""Batched text generation with a KV cache: greedy decoding or sampling (temperature, top-k, top-p).

Prompts of different lengths are left-padded into one batch. Padding never influences real
tokens: the attention mask hides padded keys, and position ids count only real tokens, so each
sequence sees exactly what it would see alone. The prompt is run once (prefill), filling the
cache; then one token per step is fed back in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from megatrain.models.common.attention import KVCache

__all__ = ["KVCache", "generate", "sample_next_tokens"]


def generate(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 0.0,
    eod: int | None = None,
    stop_token_sequences: Sequence[Sequence[int]] | None = None,
    seed: int | None = None,
    on_tokens: Callable[[list[int | None]], None] | None = None,
) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; return only the new tokens.

    ``on_tokens``, if given, is called after every decoding step with one entry per prompt: the
    token just added to its output, or None when that prompt had already stopped (for streaming).

    A sequence stops early after producing ``eod`` or after its output ends with one of
    ``stop_token_sequences``; the stop token(s) are kept at the end of its output.
    ``greedy`` takes the most likely token; otherwise tokens are sampled from the logits divided
    by ``temperature``, keeping only the ``top_k`` most likely (0: all) and the smallest set whose
    probability reaches ``top_p`` (0: all). ``seed`` makes sampling reproducible.
    """
    _check_arguments(prompt_ids, max_new_tokens, greedy, temperature, top_k, top_p)
    stop_sequences = [list(seq) for seq in (stop_token_sequences or []) if len(seq) > 0]
    if eod is not None:
        stop_sequences.append([eod])

    config = getattr(model, "config", None)
    longest = max(len(p) for p in prompt_ids)
    # The last new token is never fed back, so positions reach longest + max_new_tokens - 2.
    if (
        config is not None
        and config.position_embedding_type == "learned_absolute"
        and longest + max_new_tokens - 1 > config.max_position_embeddings
    ):
        raise ValueError(
            f"prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
            f"--max-position-embeddings ({config.max_position_embeddings})"
        )

    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            def choose(logits: torch.Tensor) -> torch.Tensor:
                return sample_next_tokens(logits, greedy, temperature, top_k, top_p, generator)

            return _generate(model, prompt_ids, max_new_tokens, device, stop_sequences, choose, on_tokens)
    finally:
        model.train(was_training)


def _generate(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    device: torch.device,
    stop_sequences: list[list[int]],
    choose: Callable[[torch.Tensor], torch.Tensor],
    on_tokens: Callable[[list[int | None]], None] | None = None,
) -> list[list[int]]:
    batch, longest = len(prompt_ids), max(len(p) for p in prompt_ids)

    # Left-pad: real tokens are right-aligned so every sequence's next token goes in the same column.
    tokens = torch.zeros(batch, longest, dtype=torch.long, device=device)
    is_real = torch.zeros(batch, longest, dtype=torch.bool, device=device)
    for i, prompt in enumerate(prompt_ids):
        tokens[i, longest - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        is_real[i, longest - len(prompt) :] = True
    position_ids = (is_real.long().cumsum(dim=1) - 1).clamp(min=0)
    padded = not bool(is_real.all())

    # Prefill. A real query attends to real keys at or before it; a pad query attends to every
    # key before it (its output is never used, but a row with no allowed key would give NaN).
    mask = None
    if padded:
        causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
        mask = causal & (is_real[:, None, :] | ~is_real[:, :, None])
        mask = mask.unsqueeze(1)  # [b, 1, s, s]
    cache = KVCache(max_length=longest + max_new_tokens)
    logits = model(tokens, position_ids=position_ids, attention_mask=mask, kv_cache=cache)[:, -1]
    next_position = position_ids[:, -1:] + 1
    key_is_real = is_real

    outputs: list[list[int]] = [[] for _ in range(batch)]
    finished = [False] * batch
    for step in range(max_new_tokens):
        next_tokens = choose(logits)  # [b]
        added: list[int | None] = [None] * batch
        for i, token in enumerate(next_tokens.tolist()):
            if not finished[i]:
                outputs[i].append(token)
                added[i] = token
                finished[i] = any(outputs[i][-len(seq) :] == seq for seq in stop_sequences)
        if on_tokens is not None:
            on_tokens(added)
        if all(finished) or step == max_new_tokens - 1:
            break
        mask = None
        if padded:
            key_is_real = torch.cat([key_is_real, key_is_real.new_ones(batch, 1)], dim=1)
            mask = key_is_real[:, None, None, :]  # [b, 1, 1, past + 1]
        logits = model(next_tokens[:, None], position_ids=next_position, attention_mask=mask, kv_cache=cache)
        logits = logits[:, -1]
        next_position = next_position + 1
    return outputs


def sample_next_tokens(
    logits: torch.Tensor,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``logits`` [b, V]; returns [b] token ids."""
    logits = logits.float()
    if greedy:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k > 0:
        kth_largest = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p > 0.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top one stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def _check_arguments(prompt_ids, max_new_tokens, greedy, temperature, top_k, top_p) -> None:
    if len(prompt_ids) == 0 or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {top_p}")
    if greedy and (top_k > 0 or top_p > 0.0):
        raise ValueError("greedy decoding cannot be combined with top_k or top_p; pass greedy=False to sample")
