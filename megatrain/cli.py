"""The `megatrain` command: one entry point for every workflow step.

    megatrain pretrain ...          same flags as pretrain_gpt.py
    megatrain pretrain-bert ...     same flags as pretrain_bert.py
    megatrain pretrain-t5 ...       same flags as pretrain_t5.py
    megatrain pretrain-vlm ...      same flags as pretrain_vlm.py (LLaVA: vision-language)
    megatrain preprocess ...        same flags as tools/preprocess_data.py
    megatrain train-tokenizer ...   train a byte-level BPE (GPT-2 format vocab.json + merges.txt)
    megatrain merge-datasets ...    join several .bin/.idx prefixes
    megatrain dataset-info ...      sizes, splits, and the first training samples
    megatrain finetune ...          same flags as finetune_gpt.py (supervised fine-tuning)
    megatrain finetune-classify ... BERT sequence classification (finetune.py with a BERT checkpoint)
    megatrain evaluate ...          same flags as tools/evaluate.py
    megatrain generate ...          text generation from a checkpoint
    megatrain fill-mask ...         a BERT checkpoint's top tokens for each [MASK] (tools/fill_mask.py)
    megatrain serve ...             same flags as tools/run_text_generation_server.py
    megatrain convert-to-hf ...     same flags as tools/convert_checkpoint_to_hf.py
    megatrain convert-from-hf ...   same flags as tools/convert_hf_to_checkpoint.py
    megatrain checkpoint-info ...   same flags as tools/checkpoint_info.py
    megatrain demo                  the built-in end-to-end demo
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function taking argv)
COMMANDS = {
    "pretrain": ("megatrain.training.main", "main"),
    "pretrain-bert": ("megatrain.training.main", "main_bert"),
    "pretrain-t5": ("megatrain.training.main", "main_t5"),
    "pretrain-vlm": ("megatrain.training.main", "main_vlm"),
    "preprocess": ("megatrain.data.preprocess", "main"),
    "train-tokenizer": ("megatrain.data.train_tokenizer", "main"),
    "merge-datasets": ("megatrain.data.merge_datasets", "main"),
    "dataset-info": ("megatrain.training.dataset_info", "main"),
    "finetune": ("megatrain.training.finetune", "main"),
    "finetune-classify": ("megatrain.training.finetune_classify", "main"),
    "evaluate": ("megatrain.inference.evaluate", "main"),
    "generate": ("megatrain.inference.text_generation", "main"),
    "fill-mask": ("megatrain.inference.fill_mask", "main"),
    "serve": ("megatrain.inference.serve", "main"),
    "convert-to-hf": ("megatrain.convert.export_hf", "main"),
    "convert-from-hf": ("megatrain.convert.import_hf", "main"),
    "checkpoint-info": ("megatrain.checkpoint.info", "main"),
    "demo": ("megatrain.demo", "main"),
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        sys.exit(f"megatrain: unknown command {name!r}{hint}; commands: {', '.join(COMMANDS)}")
    module, func = COMMANDS[name]
    getattr(importlib.import_module(module), func)(rest)


if __name__ == "__main__":
    main()
