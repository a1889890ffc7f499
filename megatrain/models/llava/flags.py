"""The LLaVA family's own flags (``pretrain_vlm.py``), with Megatron-LM's names where it has them.

Megatron-LM's multimodal example (``examples/multimodal/multimodal_args.py`` and the vision group of
``megatron/training/arguments.py``) gives: ``--vision-model-type``, ``--patch-dim``, ``--img-h``,
``--img-w``, ``--num-channels``, ``--disable-vision-class-token``, ``--freeze-LM``, ``--freeze-ViT``,
``--freeze-vision-projection``, ``--language-model-type``, ``--tokenizer-prompt-format``,
``--special-tokens``, ``--image-tag-type``, ``--num-frames``, ``--use-tiling`` (with
``--max-num-tiles``, ``--use-thumbnail``), ``--pixel-shuffle``, ``--prompt-path``,
``--dataloader-save`` and ``--allow-missing-vision-projection-checkpoint``; the older example's
``--valid-path`` (``--valid-data-path``: :func:`resolve_valid_path`) and ``--img-embedding-idx``
(ignored). Megatron fixes the
vision encoder's size by ``--vision-model-type`` (clip: ViT-L/14, 24 x 1024, 16 heads, ffn 4096) and
the projector by the language model type; megatrain's ``--vision-num-layers``,
``--vision-hidden-size``, ``--vision-num-attention-heads``, ``--vision-ffn-hidden-size``,
``--vision-feature-layer``, ``--vision-projection-type`` and ``--image-folder`` make them flags
(their defaults are Megatron's CLIP and LLaVA-1.5's choices); ``--language-model-checkpoint`` and
``--vision-model-checkpoint`` start a fresh model's parts from a GPT checkpoint and a CLIP folder;
``--decoder-seq-length`` is Megatron's multimodal language-model length; ``--packing-buffer-size`` and
``--packing-seq-length`` pack several samples into one row (Megatron's; :func:`check_packing_args`,
``megatrain/data/multimodal/packing.py``). Every other flag is the general
pre-training command line; the language model's shape is its usual ``--num-layers``,
``--hidden-size``, ... flags.
"""

from __future__ import annotations

import argparse

from megatrain.flags import flag_section

__all__ = ["add_llava_flags", "check_packing_args", "resolve_valid_path", "LLAVA_FLAGS"]

LLAVA_FLAGS = ("--vision-model-type", "--patch-dim", "--img-h", "--img-w", "--num-channels",
               "--disable-vision-class-token", "--vision-num-layers", "--vision-hidden-size",
               "--vision-num-attention-heads", "--vision-ffn-hidden-size", "--vision-feature-layer",
               "--vision-projection-type", "--freeze-LM", "--freeze-ViT", "--freeze-vision-projection",
               "--language-model-type", "--tokenizer-prompt-format", "--special-tokens", "--image-tag-type",
               "--num-frames", "--use-tiling", "--max-num-tiles", "--use-thumbnail", "--pixel-shuffle",
               "--decoder-seq-length", "--language-model-checkpoint", "--vision-model-checkpoint", "--image-folder",
               "--image-processor", "--packing-buffer-size", "--packing-seq-length", "--prompt-path", "--dataloader-save",
               "--allow-missing-vision-projection-checkpoint", "--use-te",
               "--no-use-tokenizer-model-from-checkpoint-args", "--valid-path", "--img-embedding-idx")


# Megatron's flags of what is not built: only the default value is accepted, others are refused.
_NOT_BUILT = {"--vision-model-type": "clip", "--image-tag-type": "empty", "--num-frames": "1",
              "--use-tiling": "off", "--max-num-tiles": "1", "--use-thumbnail": "off", "--pixel-shuffle": "off"}
_ACCEPTED = {"--language-model-type": "recorded only; the language model's shape is --num-layers, --hidden-size, ...",
             "--prompt-path": "not read", "--dataloader-save": "not read; the checkpoint holds the loader position",
             "--allow-missing-vision-projection-checkpoint": "not read", "--use-te": "megatrain's own layers",
             "--no-use-tokenizer-model-from-checkpoint-args": "the tokenizer is the flags'",
             "--valid-path": "Megatron's older name of --valid-data-path (the same)",
             "--img-embedding-idx": "ignored (a note says so): the images go where the <image> placeholder is"}


def add_llava_flags(parser: argparse.ArgumentParser) -> None:
    """Add the vision-language flags to ``parser`` (the general pre-training parser)."""
    g = flag_section(parser, "vision-language model")
    g.add_argument("--vision-model-type", default="clip",
                   help="vision encoder: clip (a CLIP ViT; the only type built)")
    g.add_argument("--patch-dim", type=int, default=14, help="ViT patch size in pixels")
    g.add_argument("--img-h", type=int, default=336, help="image height the ViT reads (a multiple of --patch-dim)")
    g.add_argument("--img-w", type=int, default=336, help="image width the ViT reads (a multiple of --patch-dim)")
    g.add_argument("--num-channels", type=int, default=3, help="image channels")
    g.add_argument("--disable-vision-class-token", action="store_true",
                   help="drop the class token's feature before the projector (LLaVA's 'default' strategy)")
    g.add_argument("--vision-num-layers", type=int, default=24, help="ViT layers (Megatron's clip: 24)")
    g.add_argument("--vision-hidden-size", type=int, default=1024, help="ViT width (Megatron's clip: 1024)")
    g.add_argument("--vision-num-attention-heads", type=int, default=16, help="ViT attention heads (clip: 16)")
    g.add_argument("--vision-ffn-hidden-size", type=int, default=4096, help="ViT MLP width (clip: 4096)")
    g.add_argument("--vision-feature-layer", type=int, default=-1,
                   help="the ViT hidden states the projector reads (0: embeddings, k: after k layers, "
                        "negative from the end; -1: the last layer's output, as Megatron; LLaVA-1.5: -2)")
    g.add_argument("--vision-projection-type", default="mlp", choices=["mlp", "affine"],
                   help="projector: mlp (Linear-GELU-Linear, LLaVA-1.5 and Megatron) or affine (one Linear)")
    g.add_argument("--freeze-LM", action="store_true", dest="freeze_LM",
                   help="no training of the language model (no gradients, no optimizer state)")
    g.add_argument("--freeze-ViT", action="store_true", dest="freeze_ViT",
                   help="no training of the vision encoder")
    g.add_argument("--freeze-vision-projection", action="store_true",
                   help="no training of the projector")
    g.add_argument("--language-model-type", default=None,
                   help="Megatron's language model name (mistral_7b, ...): recorded; the shape comes from "
                        "--num-layers, --hidden-size, ...")
    g.add_argument("--tokenizer-prompt-format", default=None,
                   help="Megatron's MultimodalTokenizer prompt format; with --tokenizer-type SFTTokenizer it is "
                        "--sft-tokenizer-prompt-format")
    g.add_argument("--special-tokens", nargs="*", default=["<image>"],
                   help="special tokens of the multimodal model; each must be one token of the tokenizer "
                        "(<image>: the image placeholder)")
    g.add_argument("--image-tag-type", default="", choices=["nvlm", "internvl", ""],
                   help="tags around the image tokens (not built: only the empty default)")
    g.add_argument("--num-frames", type=int, default=1, help="video frames per sample (not built: only 1)")
    g.add_argument("--use-tiling", action="store_true", help="image tiling (not built)")
    g.add_argument("--max-num-tiles", type=int, default=1, help="tiles per image with --use-tiling")
    g.add_argument("--use-thumbnail", action="store_true", help="a thumbnail tile with --use-tiling")
    g.add_argument("--pixel-shuffle", action="store_true", help="pixel shuffle of the ViT's output (not built)")
    g.add_argument("--decoder-seq-length", type=int, default=None,
                   help="Megatron's multimodal meaning: the language model's sequence length with an image "
                        "expanded (then --seq-length, if given, is the image's token count); the text of a "
                        "sample is --decoder-seq-length less the image's tokens plus its placeholder")
    g.add_argument("--language-model-checkpoint", default=None,
                   help="start the language model from this megatrain GPT checkpoint (a pretrain_gpt.py --save "
                        "folder with the same model flags), when the run loads no LLaVA checkpoint")
    g.add_argument("--vision-model-checkpoint", default=None,
                   help="start the vision encoder from this Hugging Face CLIPVisionModel folder (config.json "
                        "and safetensors; its sizes must be the vision flags'), when the run loads no LLaVA "
                        "checkpoint")
    g.add_argument("--image-folder", default=None,
                   help="the folder a LLaVA jsonl's image paths are relative to (default: the jsonl's folder)")
    g.add_argument("--image-processor", default=None,
                   help="a preprocessor_config.json (or its folder) for CLIP's image preprocessing "
                        "(default: CLIP's at --img-h)")
    g.add_argument("--packing-buffer-size", type=int, default=None,
                   help="pack several samples into one row of the micro-batch: the samples are read in buffers of "
                        "this many and each buffer is split into packs of at most --packing-seq-length positions "
                        "(Megatron's; a sample of the run is then one pack)")
    g.add_argument("--packing-seq-length", type=int, default=0,
                   help="with --packing-buffer-size: the positions of a packed row, each image counting its tokens "
                        "(a longer sample is cut to it, as Megatron does)")
    g.add_argument("--prompt-path", default=None,
                   help="Megatron's captioning prompts (accepted; captions use one fixed prompt)")
    g.add_argument("--dataloader-save", default=None,
                   help="Megatron's energon loader state path (accepted; the position is the checkpoint's "
                        "consumed-sample count)")
    g.add_argument("--allow-missing-vision-projection-checkpoint", action="store_true",
                   help="accepted: a checkpoint without a projector starts it from its initialisation")
    # Flags of Megatron's examples/multimodal/pretrain_mistral_clip.sh that the general command line
    # does not have: accepted (compatibility), nothing changes.
    g.add_argument("--use-te", action="store_true", help="Megatron's Transformer Engine layers (accepted)")
    g.add_argument("--no-use-tokenizer-model-from-checkpoint-args", action="store_false",
                   dest="use_tokenizer_model_from_checkpoint_args", help="accepted: the tokenizer is the flags'")
    # Older versions of Megatron's multimodal example (pretrain_mistral_clip.sh passes both).
    g.add_argument("--valid-path", nargs="*", default=None,
                   help="Megatron's older validation data flag: the same as --valid-data-path (an energon dataset "
                        "or metadataset's val split, or a LLaVA jsonl)")
    g.add_argument("--img-embedding-idx", type=int, default=None,
                   help="Megatron's older index where the image embeddings start in the text (accepted, ignored: "
                        "the images go where the <image> placeholder is)")
    for action in g._group_actions:  # the status docs/megatron_flags.md shows
        flag = action.option_strings[0]
        if flag in _NOT_BUILT:
            action.status = f"only {_NOT_BUILT[flag]}: other values are refused (not built)"  # type: ignore[attr-defined]
        elif flag in _ACCEPTED:
            action.status = f"compatibility: {_ACCEPTED[flag]}"  # type: ignore[attr-defined]
    for action in parser._actions:  # Megatron's multimodal tokenizer name (an SFTTokenizer here)
        if action.dest == "tokenizer_type" and action.choices is not None:
            action.choices = [*action.choices, "MultimodalTokenizer"]


def resolve_valid_path(args: argparse.Namespace) -> list[str] | None:
    """``--valid-path`` (Megatron's older name) as ``--valid-data-path``; both given and different is one
    line. Returns the validation paths."""
    old, new = getattr(args, "valid_path", None), getattr(args, "valid_data_path", None)
    if old:
        if new and list(new) != list(old):
            raise ValueError(f"--valid-path {' '.join(old)} and --valid-data-path {' '.join(new)}: give one "
                             "(--valid-path is Megatron's older name of --valid-data-path)")
        args.valid_data_path, args.valid_data_flag = list(old), "--valid-path"
    return args.valid_data_path


def check_packing_args(args: argparse.Namespace) -> bool:
    """Whether the flags ask for packing (``--packing-buffer-size`` > 0); a bad combination raises one line."""
    size = getattr(args, "packing_buffer_size", None)
    if size is None or size == 0:
        return False
    if size < 0:
        raise ValueError(f"--packing-buffer-size {size}: give a positive buffer size (or leave it out: no packing)")
    length = args.packing_seq_length
    if length is None or length < 2:
        raise ValueError(f"--packing-buffer-size {size} needs --packing-seq-length (the positions of a packed row, "
                         f"at least 2), got {length}")
    if getattr(args, "sequence_parallel", False):
        raise ValueError("--packing-buffer-size with --sequence-parallel: not supported (packed rows need an "
                         "attention mask, which the sequence-parallel language model does not take)")
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        raise ValueError("--packing-buffer-size with --pipeline-model-parallel-size > 1: not supported (the "
                         "pipeline stages take causal rows)")
    if (getattr(args, "context_parallel_size", 1) or 1) > 1:
        raise ValueError("--packing-buffer-size with --context-parallel-size > 1: not supported")
    return True
