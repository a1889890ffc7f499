"""The Hugging Face adapter a family gives (``ModelFamily.hf``): its transformers classes, and the
config and weight mappings both ways. ``megatrain.convert`` drives export and import through it.

Also the layout helpers every family's mapping needs: the grouped QKV rows of
``self_attention.linear_qkv`` split into (and joined from) separate query, key and value
projections, and the vocabulary rows trimmed to (or zero-padded up to) a size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["HFAdapter", "HFTensors", "UnsupportedModelError", "qkv_split", "qkv_join", "fit_rows"]


class UnsupportedModelError(ValueError):
    """The model (or Hugging Face folder) uses something the other side cannot represent exactly."""


class HFTensors:
    """A Hugging Face state dict read by name during an import. Every tensor taken is remembered;
    :meth:`refuse_leftovers` refuses the ones nothing took (the config does not describe them, so
    converting would drop them). ``strip``: prefixes a name may also be found without (GPT-2's
    ``transformer.``, a bare ``LlamaModel``'s missing ``model.``)."""

    def __init__(self, hf: Mapping[str, torch.Tensor], strip: tuple[str, ...] = ()) -> None:
        self.hf = hf
        self.strip = strip
        self.used: set[str] = set()

    def _find(self, name: str) -> str | None:
        for candidate in (name, *(name.removeprefix(p) for p in self.strip)):
            if candidate in self.hf:
                return candidate
        return None

    def has(self, name: str) -> bool:
        return self._find(name) is not None

    def take(self, name: str) -> torch.Tensor:
        found = self._find(name)
        if found is None:
            raise UnsupportedModelError(f"the Hugging Face weights have no tensor {name!r}")
        self.used.add(found)
        return self.hf[found]

    def mark(self, *names: str) -> None:
        """Counts ``names`` (those present) as used without taking them: tied copies some savers write."""
        self.used.update(n for n in names if n in self.hf)

    def refuse_leftovers(self, model: str = "megatrain") -> None:
        unexpected = sorted(set(self.hf) - self.used)
        if unexpected:
            raise UnsupportedModelError(
                f"the Hugging Face weights hold tensors {model} has no place for (e.g. {unexpected[:3]}); "
                "the config does not describe them, so converting would drop them")


def _no_flags(config: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class HFAdapter:
    architectures: tuple[str, ...]  # the transformers classes it converts
    accepts: Callable[[Mapping[str, Any]], bool]  # whether a Hugging Face config.json is one of them
    architecture: Callable[[Any], str]  # config -> the class to export as (UnsupportedModelError if none)
    config_dict: Callable[..., dict[str, Any]]  # (config, architecture, *, vocab_size, dtype, token ids) -> config.json
    to_hf_state_dict: Callable[..., dict[str, Any]]  # (state, config, architecture, *, vocab_size) -> HF tensors
    config_from_hf: Callable[[Mapping[str, Any], int], tuple[Any, str]]  # (config.json, padded vocab) -> (config, class)
    from_hf_state_dict: Callable[..., dict[str, Any]]  # (HF tensors, config, architecture) -> our state dict
    # Export: (config, the class the checkpoint was imported from) -> whether to write that class instead of
    # ``architecture``'s choice (a LLaMA-style model imported from Mistral goes back as Mistral).
    exports_as: Callable[[Any, str], bool] | None = None
    # Export: True writes as many vocabulary rows as the tokenizer has (the trainer's padding rows stay
    # behind; an export without a tokenizer then needs --vocab-size); False keeps the padded size.
    vocab_from_tokenizer: bool = False
    # Export: whether to write generation_config.json (the BOS/EOS ids of a generative model).
    generation_config: bool = True
    # Import: the training script the printed flags are for, and the flags of the family's own that
    # rebuild ``config`` beyond the shared transformer shape (e.g. BERT's --bert-no-binary-head).
    script: str = "pretrain_gpt.py"
    family_flags: Callable[[Any], list[str]] = _no_flags
    # Export: megatrain tokenizer -> the special ids config.json (and generation_config.json) get, where
    # the family's rule differs from the tokenizer files' (T5: the decoder starts with bos, [CLS] for
    # WordPiece, and stops at eos, [SEP]); keys bos/eos/pad/decoder_start_token_id. None: the files' ids.
    special_token_ids: Callable[[Any], dict[str, int | None]] | None = None
    # Export: entries added to the tokenizer_config.json written (T5: model_input_names without
    # token_type_ids, which T5ForConditionalGeneration does not take).
    tokenizer_config: Mapping[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# layout helpers
# ---------------------------------------------------------------------------------------------
def qkv_split(w: torch.Tensor, config: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A grouped ``linear_qkv`` weight [(n + 2g) d, ...] (or bias) -> q [n d, ...], k [g d, ...], v [g d, ...].

    Megatron's rows are ``[g, n/g + 2, d]``: per query group its query heads, then its key, then its
    value; the separate projections hold all heads in order.
    """
    g, hpg, d = config.num_query_groups, config.heads_per_group, config.kv_channels
    rest = w.shape[1:]
    grouped = w.reshape(g, hpg + 2, d, *rest)
    return (grouped[:, :hpg].reshape(g * hpg * d, *rest), grouped[:, hpg].reshape(g * d, *rest),
            grouped[:, hpg + 1].reshape(g * d, *rest))


def qkv_join(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: Any) -> torch.Tensor:
    """The inverse of :func:`qkv_split`."""
    g, hpg, d = config.num_query_groups, config.heads_per_group, config.kv_channels
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(g, hpg, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
    return grouped.reshape(g * (hpg + 2) * d, *rest)


def fit_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``w``, or ``w`` with zero rows appended up to ``rows`` (vocabulary padding)."""
    if w.shape[0] >= rows:
        return w[:rows]
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


class ConfigFields:
    """Reads fields of a Hugging Face ``config.json`` with the class's defaults for the ones it omits (or
    sets to null); a field that should be a number and is not raises the one-line UnsupportedModelError."""

    def __init__(self, hf: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        self.hf, self.defaults = hf, defaults

    def get(self, key: str) -> Any:
        value = self.hf.get(key)
        return self.defaults[key] if value is None else value

    def number(self, key: str, kind: type) -> Any:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise UnsupportedModelError(f"config.json field {key}: expected a number, got {value!r}")
        return kind(value)
