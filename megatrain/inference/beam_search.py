"""Beam search over a decoder-only model with a KV cache: Megatron-LM's ``beam_width`` of ``PUT /api``
(``megatron/inference/text_generation/generation.py`` ``beam_search_and_return_on_first_stage`` and
``beam_utils.BeamHypotheses`` of Megatron-LM up to core v0.8, whose algorithm this follows).

One prompt, ``beam_size`` beams. Each step every beam's next-token log-probabilities (log-softmax of
the raw logits, over the tokenizer's ids) are added to its score; the ``2 * beam_size`` best
(beam, token) pairs are taken in order: a pair whose token is ``stop_token`` ends a hypothesis (if it
ranks among the first ``beam_size``), the others continue, until ``beam_size`` beams continue. A
hypothesis scores ``sum of logprobs / length ** length_penalty`` (``length``: generated tokens, the
stop token counted). The search ends when ``beam_size`` hypotheses are kept and no open beam can beat
the worst of them, or after ``tokens_to_generate`` tokens (then the open beams become hypotheses too).
``prevent_newline_after_colon`` forbids the newline token right after a colon token.

Megatron returns its padded token buffer; here each hypothesis is its prompt and generated tokens
(without the stop token that ended it). The cache holds one row per beam and is reordered to the
surviving beams after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatrain.models.common.attention import KVCache


@dataclass
class BeamHypotheses:
    """The ``num_beams`` best finished hypotheses (Megatron's ``BeamHypotheses``, early_stopping off)."""

    num_beams: int
    length_penalty: float = 1.0
    beams: list[tuple[float, list[int]]] = field(default_factory=list)
    worst_score: float = 1e9

    def add(self, tokens: list[int], sum_logprobs: float, length: int) -> None:
        score = sum_logprobs / length ** self.length_penalty
        if len(self.beams) < self.num_beams or score > self.worst_score:
            self.beams.append((score, tokens))
            if len(self.beams) > self.num_beams:
                ranked = sorted((s, i) for i, (s, _) in enumerate(self.beams))
                del self.beams[ranked[0][1]]
                self.worst_score = ranked[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs: float, length: int) -> bool:
        if len(self.beams) < self.num_beams:
            return False
        return self.worst_score >= best_sum_logprobs / length ** self.length_penalty


def _reorder(cache: KVCache, rows: torch.Tensor) -> None:
    """Keep the cache rows of the surviving beams, in their new order."""
    # KVCache has no reorder method (megatrain/models/common/attention.py is not this module's); its
    # per-layer storage is [b, groups, max_length, d] tensors keyed by layer number.
    for store in (cache._keys, cache._values):  # noqa: SLF001
        for layer, tensor in store.items():
            store[layer] = tensor.index_select(0, rows)


def beam_search(model: nn.Module, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload``: ``prompt_ids``, ``tokens_to_generate``, ``beam_size``, ``stop_token``,
    ``length_penalty``, ``num_return_gen``, ``vocab_size``, ``max_positions`` (or None) and
    ``newline_after_colon`` (None, or ``[colon_id, newline_id]`` to forbid). Returns ``{"tokens": [...],
    "scores": [...]}``, best first: each hypothesis's prompt + generated ids and its score."""
    prompt = [int(t) for t in payload["prompt_ids"]]
    beam_size = int(payload["beam_size"])
    stop_token = int(payload["stop_token"])
    vocab_size = int(payload["vocab_size"])
    ban = payload.get("newline_after_colon")
    final_length = len(prompt) + int(payload["tokens_to_generate"])
    if payload.get("max_positions") is not None:
        final_length = min(final_length, int(payload["max_positions"]))
    if len(prompt) >= final_length:
        raise ValueError("context length + tokens_to_generate too large")
    device = next(model.parameters()).device
    hyps = BeamHypotheses(beam_size, float(payload["length_penalty"]))
    cache = KVCache(max_length=final_length)
    tokens = [list(prompt) for _ in range(beam_size)]
    scores = torch.zeros(beam_size, 1, device=device)
    done = False
    with torch.inference_mode():
        inputs = torch.tensor(tokens, dtype=torch.long, device=device)
        positions = torch.arange(len(prompt), device=device).expand(beam_size, -1)
        length = len(prompt)
        while True:
            logits = model(inputs, position_ids=positions, kv_cache=cache)[:, -1, :vocab_size].float()
            if ban is not None:
                after_colon = torch.tensor([t[-1] == ban[0] for t in tokens], device=device)
                logits[after_colon, ban[1]] = -1e10
            new_scores = logits.log_softmax(-1) + scores
            flat = new_scores[0] if length == len(prompt) else new_scores.view(-1)
            best_scores, order = torch.sort(flat, descending=True)
            best_scores, order = best_scores[:2 * beam_size].tolist(), order[:2 * beam_size].tolist()
            generated = length + 1 - len(prompt)
            next_beams: list[tuple[int, float, int]] = []
            for rank, (index, beam_score) in enumerate(zip(order, best_scores)):
                beam, token = divmod(index, vocab_size)
                if token == stop_token:
                    if rank < beam_size:
                        hyps.add(list(tokens[beam]), beam_score, generated)
                else:
                    next_beams.append((token, beam_score, beam))
                if len(next_beams) == beam_size:
                    break
            done = hyps.is_done(max(best_scores), generated)
            rows = [beam for _, _, beam in next_beams]
            tokens = [tokens[beam] + [token] for token, _, beam in next_beams]
            scores = torch.tensor([[s] for _, s, _ in next_beams], device=device)
            length += 1
            if done or length >= final_length:
                break
            _reorder(cache, torch.tensor(rows, dtype=torch.long, device=device))
            inputs = torch.tensor([[t[-1]] for t in tokens], dtype=torch.long, device=device)
            positions = torch.full((beam_size, 1), length - 1, dtype=torch.long, device=device)
    if not done:
        for beam in range(beam_size):
            hyps.add(list(tokens[beam]), float(scores[beam, 0]), length - len(prompt))
    ranked = sorted(hyps.beams, key=lambda b: b[0], reverse=True)[:int(payload.get("num_return_gen", beam_size))]
    return {"tokens": [t for _, t in ranked], "scores": [s for s, _ in ranked]}
