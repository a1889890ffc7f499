"""Supervised fine-tuning (`finetune_gpt.py`, `megatrain finetune`, and Megatron's `pretrain_gpt.py --sft`):
the pre-training loop on jsonl prompt/response or chat examples, with the loss on response tokens only.

Takes every pretrain_gpt.py flag; ``--data-path`` (or ``--train-data-path``/``--valid-data-path``) names
jsonl files of ``{"prompt", "response"}`` or ``{"messages": [...]}`` examples (see
megatrain/data/sft_dataset.py and docs/finetune.md). Start from a pre-trained or imported checkpoint
with ``--load CKPT --finetune``.

With ``--tokenizer-type SFTTokenizer`` (required by ``pretrain_gpt.py --sft``) the files are Megatron's
SFT conversations instead, one packed sample per line, rendered by ``--sft-tokenizer-prompt-format``
(megatrain/data/sft_conversations.py); the batches are the same kind.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import torch

from megatrain.data.batch import CausalLMBatch, mtp_fields
from megatrain.data.sft_conversations import build_conversation_datasets
from megatrain.data.sft_dataset import SFTConfig, build_sft_datasets, sft_batch
from megatrain.data.tokenizers.sft import IGNORE_INDEX, SFTTokenizer
from megatrain.errors import user_errors_exit
from megatrain.models.gpt.objective import CausalLMObjective
from megatrain.parallel.distributed import setup_env_from_slurm
from megatrain.training.arguments import build_parser as build_pretrain_parser
from megatrain.training.arguments import parse_args
from megatrain.training.trainer import Trainer, pretrain


def build_parser() -> argparse.ArgumentParser:
    p = build_pretrain_parser(prog="finetune_gpt.py")
    g = p.add_argument_group("fine-tuning")
    g.add_argument("--sft-pack", action="store_true",
                   help="pack several examples into each --seq-length sample (default: one example per "
                        "sample, padded)")
    g.add_argument("--sft-prompt-key", default="prompt", help="jsonl key of the prompt")
    g.add_argument("--sft-response-key", default="response", help="jsonl key of the response")
    g.add_argument("--sft-messages-key", default="messages", help="jsonl key of a chat's message list")
    return p


class SFTObjective(CausalLMObjective):
    """Next-token prediction on fine-tuning samples: their own (response-only) loss mask, position ids
    and attention mask restarting at every packed example."""

    batches_in_cuda_graph = False  # sft_batch decides on the host whether a batch needs an attention mask
    sparse_labels = True  # the prompts' labels are ignored (forward)

    def make_batch(self, samples: Any) -> CausalLMBatch:
        batch = sft_batch(samples)
        if self.mtp_depths:  # --mtp-num-layers: the response tokens' further targets
            batch = replace(batch, **mtp_fields(batch.tokens, batch.labels, batch.loss_mask, self.mtp_depths))
        return batch

    def forward(self, model: Any, batch: CausalLMBatch) -> torch.Tensor:
        # The prompts' labels ignored (their loss is masked out anyway), so that the chunked loss head runs
        # the output layer on the response tokens alone (sparse_labels).
        return super().forward(model, replace(batch, labels=batch.labels.masked_fill(batch.loss_mask == 0,
                                                                                     IGNORE_INDEX)))


class SFTTrainer(Trainer):
    """The pre-training loop with jsonl examples whose batches carry their own (response-only) loss mask."""

    def build_objective(self) -> SFTObjective:
        return SFTObjective(mtp_depths=getattr(self.args, "mtp_num_layers", None) or 0)

    def build_datasets(self, num_samples: list[int]) -> tuple[Any, Any, Any]:
        a = self.args
        if isinstance(self.tokenizer, SFTTokenizer):  # Megatron's SFT conversations
            return build_conversation_datasets(self.run.data, self.tokenizer, a.seq_length, num_samples)
        config = SFTConfig(a.seq_length, pack=a.sft_pack, prompt_key=a.sft_prompt_key,
                           response_key=a.sft_response_key, messages_key=a.sft_messages_key)
        per_split = None
        if a.train_data_path:
            per_split = [a.train_data_path, a.valid_data_path, a.test_data_path]
        return build_sft_datasets(a.data_path, a.split, self.tokenizer, config, num_samples, a.seed,
                                  per_split_paths=per_split)


def check_sft_args(args: argparse.Namespace, script: str) -> None:
    """The flags of a run on Megatron's SFT conversations (``--sft`` of ``pretrain_gpt.py``, or
    ``finetune_gpt.py`` with ``--tokenizer-type SFTTokenizer``): what Megatron's SFT dataset refuses
    or ignores is refused with the flag named."""
    if args.tokenizer_type != "SFTTokenizer":
        raise SystemExit(f"error: {script} --sft reads Megatron's SFT conversations, which need --tokenizer-type "
                         "SFTTokenizer (--tokenizer-model DIR, --sft-tokenizer-prompt-format FORMAT); for "
                         "prompt/response or chat jsonl with another tokenizer use finetune_gpt.py")
    refused = [(args.mock_data, "--mock-data (the conversations come from --data-path jsonl files)"),
               (args.reset_position_ids, "--reset-position-ids (positions restart at every conversation)"),
               (args.reset_attention_mask, "--reset-attention-mask (attention stays inside every conversation)"),
               (args.context_parallel_size > 1, "--context-parallel-size > 1 (a conversation's attention mask "
                                                "cannot be split over context-parallel ranks here)"),
               (getattr(args, "sft_pack", False), "--sft-pack (every line is packed into one sample)")]
    for key in ("prompt", "response", "messages"):
        given = getattr(args, f"sft_{key}_key", key)
        refused.append((given != key, f"--sft-{key}-key {given} (the conversations are under \"messages\")"))
    given = [why for bad, why in refused if bad]
    if given:
        what = "--sft" if args.sft else "--tokenizer-type SFTTokenizer (Megatron's SFT conversations)"
        raise SystemExit(f"error: {what} cannot be used with {given[0]}")


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    setup_env_from_slurm()
    args = parse_args(argv, parser=build_parser())
    if args.tokenizer_type == "SFTTokenizer":
        check_sft_args(args, "finetune_gpt.py")
    pretrain(args, trainer_class=SFTTrainer)
