"""The LLaVA family's registry entry (``pretrain_vlm.py``): the config from the flags, the model with
its frozen parts, the objective, the datasets, and the script's flag preparation and checks.

One process, data parallel, tensor / sequence parallel (the language model sharded by the GPT
family's plan, the vision encoder and projector replicated on every tensor-parallel rank:
:mod:`megatrain.models.llava.parallelize`) and pipeline parallel (the vision encoder and projector on
the first stage, the language model's layers split as the GPT family's, one sequence length per run:
:mod:`megatrain.models.llava.stage`; with ``--freeze-LM`` the later stages hold only frozen layers and
step an optimizer over empty groups: :meth:`megatrain.training.trainer.Trainer._build_optimizer`);
context and expert parallelism, and virtual pipeline stages, are refused with one line naming the
flag, before anything is built, as is freezing every part. What Megatron's multimodal example has and
megatrain has not built (tiling, video frames, pixel shuffle, image tags, other vision encoders) is
refused with why.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from megatrain.models.gpt.config import gpt_config_from_args
from megatrain.models.llava.checkpoint_compat import CONFIG_CHECKS
from megatrain.models.llava.config import MEGATRON_IMAGE_TOKEN_ID, LlavaConfig, VisionConfig
from megatrain.models.llava.flags import add_llava_flags, resolve_valid_path
from megatrain.models.llava.flops import batch_flops_counter, num_floating_point_operations
from megatrain.models.llava.hf import FAMILY_ADAPTER
from megatrain.models.llava.model import LlavaModel, initial_value
from megatrain.models.llava.objective import PARALLEL_REFUSAL, LlavaObjective
from megatrain.models.llava.parallelize import tensor_parallel_plan
from megatrain.models.llava.stage import LlavaStage, pipeline_length
from megatrain.models.registry import ModelFamily, register

__all__ = ["LLAVA", "llava_config_from_args", "prepare_llava_args", "check_llava_args"]

_PARALLEL_FLAGS = (("context_parallel_size", "--context-parallel-size"),
                   ("expert_model_parallel_size", "--expert-model-parallel-size"))


def llava_config_from_args(args: argparse.Namespace, vocab_size: int) -> LlavaConfig:
    """The LlavaConfig of the flags: the language model from the general model flags (GPT's), the ViT
    from the vision flags, the projector and the frozen parts from the family's."""
    vision = VisionConfig(
        num_layers=args.vision_num_layers, hidden_size=args.vision_hidden_size,
        num_attention_heads=args.vision_num_attention_heads, ffn_hidden_size=args.vision_ffn_hidden_size,
        vision_model_type=args.vision_model_type, patch_dim=args.patch_dim, img_h=args.img_h, img_w=args.img_w,
        num_channels=args.num_channels, init_method_std=args.init_method_std)
    return LlavaConfig(
        language=gpt_config_from_args(args, vocab_size), vision=vision, projector_type=args.vision_projection_type,
        image_token_id=MEGATRON_IMAGE_TOKEN_ID, vision_feature_layer=args.vision_feature_layer,
        vision_feature_select_strategy="default" if args.disable_vision_class_token else "full",
        freeze_language_model=args.freeze_LM, freeze_vision_model=args.freeze_ViT,
        freeze_projector=args.freeze_vision_projection)


def _note(args: argparse.Namespace, line: str) -> None:
    if isinstance(getattr(args, "legacy_notes", None), list):
        args.legacy_notes.append(f"note: {line}")


def _map_encoder_layout(args: argparse.Namespace) -> None:
    """Megatron's separate encoder layout: ``--encoder-pipeline-model-parallel-size 1`` is one more pipeline
    stage, holding the vision encoder and projector and no language-model layer (megatrain's first stage
    also holds the language model's embedding, which Megatron's first decoder stage holds: the same
    numbers); ``--encoder-tensor-model-parallel-size`` up to the tensor-parallel size (the encoder is
    replicated on the tensor-parallel ranks in every case)."""
    epp = getattr(args, "encoder_pipeline_model_parallel_size", 0) or 0
    etp = getattr(args, "encoder_tensor_model_parallel_size", 0) or 0
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if epp not in (0, 1):
        raise ValueError(f"--encoder-pipeline-model-parallel-size {epp}: the vision encoder and projector live on "
                         "one pipeline stage (0 or 1, as in Megatron)")
    if not 0 <= etp <= tp:
        raise ValueError(f"--encoder-tensor-model-parallel-size {etp}: at most --tensor-model-parallel-size ({tp})")
    if etp:
        _note(args, f"--encoder-tensor-model-parallel-size {etp}: the vision encoder is replicated on the "
                    "tensor-parallel ranks (the same numbers)")
    if epp:
        if getattr(args, "decoder_first_pipeline_num_layers", None) not in (None, 0):
            raise ValueError("--encoder-pipeline-model-parallel-size 1 gives the encoder a stage of its own: "
                             "--decoder-first-pipeline-num-layers must then be left out")
        decoder_stages = getattr(args, "pipeline_model_parallel_size", 1) or 1
        args.pipeline_model_parallel_size = decoder_stages + 1  # the layers split evenly over the others
        args.decoder_first_pipeline_num_layers = 0
        _note(args, f"--encoder-pipeline-model-parallel-size 1: {decoder_stages + 1} pipeline stages, the "
                    "vision encoder and projector (and the language model's embedding) on the first, the "
                    f"language model's layers on the other {decoder_stages}")
    args.encoder_pipeline_model_parallel_size = args.encoder_tensor_model_parallel_size = 0


def prepare_llava_args(args: argparse.Namespace) -> None:
    """Before the general checks: the parallel layouts and Megatron's unbuilt features refused,
    Megatron's tokenizer and loader names mapped to megatrain's."""
    for dest, flag in _PARALLEL_FLAGS:
        if (getattr(args, dest, 1) or 1) > 1:
            raise ValueError(PARALLEL_REFUSAL.format(flag=flag))
    _map_encoder_layout(args)
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        pp, per_stage = args.pipeline_model_parallel_size, getattr(args, "num_layers_per_virtual_pipeline_stage", None)
        virtual = [flag for flag, given in (
            ("--num-virtual-stages-per-pipeline-rank", (getattr(args, "num_virtual_stages_per_pipeline_rank", None)
                                                        or 1) > 1),
            ("--num-layers-per-virtual-pipeline-stage", bool(per_stage) and args.num_layers // pp > per_stage))
            if given]
        if virtual:
            raise ValueError(f"{virtual[0]}: the LLaVA family (pretrain_vlm.py) runs one pipeline stage per rank "
                             "(the vision encoder on the first)")
    resolve_valid_path(args)
    if getattr(args, "img_embedding_idx", None) is not None:
        _note(args, f"--img-embedding-idx {args.img_embedding_idx}: ignored; the images go where the <image> "
                    "placeholder is in the text")
    if args.vision_model_type != "clip":
        raise ValueError(f"--vision-model-type {args.vision_model_type}: only clip (a CLIP ViT) is built; "
                         "Megatron's siglip, radio and internvit encoders are not")
    unbuilt = [(args.use_tiling, "--use-tiling", "image tiling (several tiles per image) is not built"),
               (args.use_thumbnail, "--use-thumbnail", "thumbnail tiles come with tiling, which is not built"),
               (args.max_num_tiles != 1, f"--max-num-tiles {args.max_num_tiles}", "tiling is not built"),
               (args.num_frames != 1, f"--num-frames {args.num_frames}", "video (several frames per sample) is "
                "not built: give images"),
               (args.pixel_shuffle, "--pixel-shuffle", "the ViT's features go to the projector as they are"),
               (bool(args.image_tag_type), f"--image-tag-type {args.image_tag_type}", "tags around the image "
                "tokens (nvlm, internvl) are not built")]
    for given, flag, why in unbuilt:
        if given:
            raise ValueError(f"{flag}: not supported by pretrain_vlm.py ({why})")
    if args.tokenizer_type == "MultimodalTokenizer":  # Megatron's: a HF tokenizer with a prompt format
        from megatrain.data.tokenizers.sft import PROMPT_FORMATS

        fmt = args.tokenizer_prompt_format
        if fmt not in PROMPT_FORMATS:
            raise ValueError(f"--tokenizer-type MultimodalTokenizer --tokenizer-prompt-format {fmt}: megatrain's "
                             f"prompt formats are {', '.join(PROMPT_FORMATS)}; or give --tokenizer-type "
                             "HuggingFaceTokenizer to render conversations with the tokenizer's chat template")
        args.tokenizer_type, args.sft_tokenizer_prompt_format = "SFTTokenizer", fmt
        _note(args, f"--tokenizer-type MultimodalTokenizer: SFTTokenizer with the prompt format {fmt}")
    elif args.tokenizer_prompt_format is not None:
        if args.tokenizer_type != "SFTTokenizer":
            raise ValueError(f"--tokenizer-prompt-format needs --tokenizer-type SFTTokenizer (or Megatron's "
                             f"MultimodalTokenizer), got {args.tokenizer_type}")
        args.sft_tokenizer_prompt_format = args.tokenizer_prompt_format
    if args.decoder_seq_length is not None:  # Megatron's multimodal lengths: --seq-length is the image's
        per_side = (args.img_h // args.patch_dim) * (args.img_w // args.patch_dim)
        image_tokens = per_side + (0 if args.disable_vision_class_token else 1)
        if args.seq_length is not None and args.seq_length != image_tokens:
            raise ValueError(f"--seq-length {args.seq_length} with --decoder-seq-length: Megatron's multimodal "
                             f"--seq-length is the image's token count, {image_tokens} here (--img-h, --img-w, "
                             "--patch-dim, --disable-vision-class-token)")
        text = args.decoder_seq_length - image_tokens + 1
        if text < 2:
            raise ValueError(f"--decoder-seq-length {args.decoder_seq_length} leaves no text after the image's "
                             f"{image_tokens} tokens")
        args.seq_length = text
        _note(args, f"--decoder-seq-length {args.decoder_seq_length}: samples of {text} text tokens (one image "
                    f"placeholder standing for {image_tokens} positions)")
    if args.dataloader_type == "external":  # Megatron's energon loader: megatrain's loader reads it
        args.dataloader_type = "single"
        _note(args, "--dataloader-type external: megatrain's loader reads the dataset (resumed from the "
                    "checkpoint's consumed samples)")
    if args.mock_data:
        raise ValueError("--mock-data: there is no mock vision-language dataset; give --data-path with a LLaVA "
                         "jsonl file or an energon dataset folder")


def check_llava_args(args: argparse.Namespace) -> None:
    """After the general checks: the expanded sequence (text plus each image's positions) must fit the
    language model's learned positions; GPT token-data flags have no use here."""
    given = [flag for dest, flag in (("reset_position_ids", "--reset-position-ids"),
                                     ("reset_attention_mask", "--reset-attention-mask")) if getattr(args, dest, False)]
    if given:
        raise ValueError(f"{', '.join(given)}: not used by vision-language conversations (one per row); remove it")
    if args.position_embedding_type == "learned_absolute":
        cfg = llava_config_from_args(args, 1)
        longest = args.seq_length + cfg.tokens_per_image - 1
        if longest > args.max_position_embeddings:
            raise ValueError(f"--max-position-embeddings ({args.max_position_embeddings}) must cover --seq-length "
                             f"({args.seq_length}) plus an image's {cfg.tokens_per_image} positions less its "
                             f"placeholder: {longest}")
    if args.freeze_LM and args.freeze_ViT and args.freeze_vision_projection:
        raise ValueError("--freeze-LM --freeze-ViT --freeze-vision-projection: every part is frozen, nothing "
                         "would train")


def _objective(args: Any, tokenizer: Any) -> LlavaObjective:
    """Under pipeline parallelism the objective lays micro-batches out for the stages (``stage.py``)."""
    config = llava_config_from_args(args, getattr(args, "padded_vocab_size", None) or 1)
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) == 1:
        return LlavaObjective(config)
    multiple = args.tensor_model_parallel_size if getattr(args, "sequence_parallel", False) else 1
    return LlavaObjective(config, pipeline_length(config, args.seq_length, multiple))


def _datasets(args: Any, tokenizer: Any, num_samples: Sequence[int | None]):
    from megatrain.models.llava.datasets import build_llava_datasets

    return build_llava_datasets(args, tokenizer, num_samples)


def _vision_state_from_hf(hf_config: Any, tensors: Any) -> dict[str, Any]:
    from megatrain.models.llava.hf import vision_encoder_from_hf

    return vision_encoder_from_hf(hf_config, tensors).state_dict()


def _start_parts(args: Any) -> list:
    """``--language-model-checkpoint`` (a megatrain GPT checkpoint) and ``--vision-model-checkpoint``
    (a Hugging Face CLIPVisionModel folder): the parts a fresh model starts from."""
    parts = []
    if getattr(args, "language_model_checkpoint", None):
        parts.append(("--language-model-checkpoint", "language_model", args.language_model_checkpoint, None))
    if getattr(args, "vision_model_checkpoint", None):
        parts.append(("--vision-model-checkpoint", "vision_model", args.vision_model_checkpoint, _vision_state_from_hf))
    return parts


def _flops(config: LlavaConfig, batch_size: int, seq_length: int) -> float:
    """The nominal FLOPs of a batch: ``seq_length`` is the text's (``--seq-length``), one placeholder per
    sample standing for an image's ``tokens_per_image`` positions, so the language model runs
    ``seq_length - 1 + tokens_per_image`` positions per sample with one image each. The log line counts
    the images and positions each iteration ran instead (``batch_flops``: :func:`batch_flops_counter`)."""
    return num_floating_point_operations(config, batch_size, seq_length - 1 + config.tokens_per_image)


def _build_stage(config: LlavaConfig, layer_ids: Sequence[int], *, stage_index: int, num_stages: int) -> LlavaStage:
    return LlavaStage(config, layer_ids, stage_index=stage_index, num_stages=num_stages)


LLAVA = register(ModelFamily(
    name="llava",
    config_class=LlavaConfig,
    config_from_args=llava_config_from_args,
    build_model=LlavaModel,
    build_stage=_build_stage,
    initial_value=initial_value,
    tensor_parallel_plan=tensor_parallel_plan,
    objective=_objective,
    flops=_flops,
    batch_flops=batch_flops_counter,
    config_checks=CONFIG_CHECKS,
    hf=FAMILY_ADAPTER,
    datasets=_datasets,
    add_flags=add_llava_flags,
    prepare_args=prepare_llava_args,
    check_args=check_llava_args,
    start_parts=_start_parts,
    script="pretrain_vlm.py",
    description="LLaVA: a CLIP ViT, a projector and a GPT-family language model (vision-language)",
))
