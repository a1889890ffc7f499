"""`tools/run_text_generation_server.py`: load a checkpoint and serve it (see megatrain.inference.server).

Megatron's launch lines work: its model shape flags are checked against the checkpoint's stored
config (a mismatch is one line naming the flag; ``--use-checkpoint-args`` is what happens anyway),
its performance and run flags are accepted, and ``torchrun --nproc_per_node N ...
--tensor-model-parallel-size N`` serves a tensor-parallel model: every rank loads its shards and runs
the engine, rank 0 answers HTTP. Pipeline parallelism is refused.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from megatrain.convert.hf_start import resolve_load
from megatrain.data.tokenizers import add_tokenizer_args, build_tokenizer
from megatrain.errors import user_errors_exit
from megatrain.inference.loading import fill_tokenizer_args, load_model
from megatrain.inference.server import ServerLimits, build_engine, make_context, make_server
from megatrain.inference.text_generation import model_dtype, tensor_parallel_mesh
from megatrain.inference.vision import text_config
from megatrain.parallel.distributed import destroy_distributed
from megatrain.training.builders import choose_device
from megatrain.flags import OneLineArgumentParser

# Megatron's model shape flags: (flag, config field, type); each given one must equal the checkpoint's.
SHAPE_FLAGS: tuple[tuple[str, str, Any], ...] = (
    ("--num-layers", "num_layers", int), ("--hidden-size", "hidden_size", int),
    ("--num-attention-heads", "num_attention_heads", int), ("--ffn-hidden-size", "ffn_hidden_size", int),
    ("--kv-channels", "kv_channels", int), ("--num-query-groups", "num_query_groups", int),
    ("--max-position-embeddings", "max_position_embeddings", int),
    ("--position-embedding-type", "position_embedding_type", str), ("--normalization", "normalization", str),
    ("--norm-epsilon", "norm_epsilon", float), ("--rotary-base", "rotary_base", float),
    ("--rotary-percent", "rotary_percent", float), ("--num-experts", "num_moe_experts", int),
    ("--moe-router-topk", "moe_router_topk", int), ("--decoder-num-layers", "decoder_layers", int),
    # multi-latent attention's
    ("--q-lora-rank", "q_lora_rank", int), ("--kv-lora-rank", "kv_lora_rank", int),
    ("--qk-head-dim", "qk_head_dim", int), ("--qk-pos-emb-head-dim", "qk_pos_emb_head_dim", int),
    ("--v-head-dim", "v_head_dim", int), ("--rope-type", "rope_type", str),
    ("--rotary-scaling-factor", "rotary_scaling_factor", float), ("--mscale", "mscale", float),
    ("--mscale-all-dim", "mscale_all_dim", float),
    ("--yarn-original-max-position-embeddings", "yarn_original_max_position_embeddings", int),
    ("--yarn-beta-fast", "yarn_beta_fast", float), ("--yarn-beta-slow", "yarn_beta_slow", float),
)
SHAPE_SWITCHES: tuple[tuple[str, str, bool], ...] = (  # (flag, config field, the field's value it means)
    ("--swiglu", "swiglu", True), ("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights", True),
    ("--disable-bias-linear", "add_bias_linear", False), ("--add-qkv-bias", "add_qkv_bias", True),
    ("--qk-layernorm", "qk_layernorm", True), ("--multi-latent-attention", "multi_latent_attention", True),
)
# Accepted and without effect here: run, kernel and sampling-default flags of Megatron's scripts.
ACCEPTED_VALUES = ("--micro-batch-size", "--seed", "--seq-length", "--distributed-backend",
                   "--distributed-timeout-minutes", "--attention-dropout", "--hidden-dropout", "--transformer-impl",
                   "--attention-backend", "--temperature", "--top_k", "--top_p", "--num-tokens-to-generate",
                   "--make-vocab-size-divisible-by", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
                   "--encoder-seq-length", "--decoder-seq-length", "--moe-token-dispatcher-type",
                   "--moe-router-dtype", "--cuda-graph-impl", "--dist-ckpt-strictness")
ACCEPTED_SWITCHES = ("--use-checkpoint-args", "--use-mcore-models", "--use-flash-attn", "--no-load-rng",
                     "--no-load-optim", "--sequence-parallel", "--return-log-probs", "--group-query-attention",
                     "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                     "--no-gradient-accumulation-fusion", "--use-rotary-position-embeddings",
                     "--exit-on-missing-checkpoint", "--te-rng-tracker", "--inference-rng-tracker")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="run_text_generation_server.py", allow_abbrev=False,
                                description="Serve a megatrain checkpoint: PUT /api, POST /v1/completions, "
                                            "POST /v1/chat/completions.")
    p.add_argument("--load", required=True,
                   help="checkpoint directory (a --save directory or one iter_ folder), or a Hugging Face model "
                        "folder (hf:DIR, or DIR holding config.json)")
    p.add_argument("--ckpt-step", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--model-name", default="megatrain", help="the model id of GET /v1/models")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt accepted (default: the engine's sequence length)")
    p.add_argument("--max-tokens-to-generate", type=int, default=1024)
    p.add_argument("--max-batch-size", type=int, default=16,
                   help="most sequences one request may generate (prompts x choices)")
    p.add_argument("--inference-max-requests", "--inference-max-batch-size", dest="inference_max_requests",
                   type=int, default=16, help="sequences decoded at once (the engine's KV-cache slots)")
    p.add_argument("--inference-max-seq-length", type=int, default=None,
                   help="prompt + generated tokens of one sequence (default: the model's positions, at most 4096)")
    p.add_argument("--inference-max-waiting", type=int, default=256,
                   help="sequences waiting for a slot; beyond them requests get 503")
    p.add_argument("--inference-compile", action="store_true",
                   help="the engine's decode and prefill forwards through torch.compile (on CUDA inside the decode "
                        "graphs, all recorded at start-up: a longer start, faster steps and far fewer host "
                        "operations per step, which keeps the engine fast while the HTTP side is busy)")
    p.add_argument("--frontend-process", action="store_true",
                   help="answer HTTP from a child process that reaches the engine through a pipe, so the "
                        "engine's thread does not share the interpreter lock with the HTTP side (text models)")
    p.add_argument("--max-pending-requests", type=int, default=1024, help="requests answered at once; more: 503")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    p.add_argument("--request-body-timeout", type=float, default=30.0,
                   help="seconds to wait for a request body to arrive in full before answering 408")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="serve the model split over this many processes (launch with torchrun)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="must be 1 (refused otherwise)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no per-request log lines")
    shape = p.add_argument_group("model shape (Megatron's flags; checked against the checkpoint)")
    for flag, _, kind in SHAPE_FLAGS:
        shape.add_argument(flag, type=kind, default=None)
    for flag, _, _ in SHAPE_SWITCHES:
        shape.add_argument(flag, action="store_true", default=None)
    accepted = p.add_argument_group("accepted for Megatron's scripts (no effect on serving)")
    for flag in ACCEPTED_VALUES:
        accepted.add_argument(flag, default=None)
    for flag in ACCEPTED_SWITCHES:
        accepted.add_argument(flag, action="store_true")
    add_tokenizer_args(p)
    return p


def check_shape_flags(args: argparse.Namespace, config: Any) -> None:
    """One line naming the first shape flag that differs from the checkpoint's config."""
    for flag, name, _ in SHAPE_FLAGS:
        given = getattr(args, flag[2:].replace("-", "_"))
        have = getattr(config, name, None)
        if name == "rope_type" and have is None:
            have = "rope"  # attention other than multi-latent: plain RoPE (Megatron's --rope-type rope)
        if given is not None and hasattr(config, name) and have != given:
            raise SystemExit(f"error: {flag} {given} does not match the checkpoint's {name} = "
                             f"{have} (--load {args.load})")
    for flag, name, meaning in SHAPE_SWITCHES:
        if getattr(args, flag[2:].replace("-", "_")) and getattr(config, name, meaning) != meaning:
            raise SystemExit(f"error: {flag} does not match the checkpoint, whose {name} is {getattr(config, name)} "
                             f"(--load {args.load})")
    if args.group_query_attention and config.num_query_groups in (None, config.num_attention_heads):
        raise SystemExit(f"error: --group-query-attention does not match the checkpoint, which has no grouped-query "
                         f"attention (--load {args.load})")


def _check_flags(args: argparse.Namespace) -> None:
    for flag in ("max_tokens_to_generate", "max_batch_size", "max_request_bytes", "inference_max_requests",
                 "max_pending_requests"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be positive")
    if args.inference_max_waiting < 0:
        raise SystemExit("error: --inference-max-waiting must be >= 0")
    if not args.request_body_timeout > 0:
        raise SystemExit("error: --request-body-timeout must be a positive number of seconds")
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"error: --port must be in 0..65535, got {args.port}")
    if args.pipeline_model_parallel_size != 1:
        raise SystemExit("error: --pipeline-model-parallel-size must be 1: the server runs tensor parallelism only "
                         "(a pipeline-parallel checkpoint loads into any layout: serve it with "
                         "--tensor-model-parallel-size)")


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    _check_flags(args)
    resolve_load(args, args.tensor_model_parallel_size)  # a Hugging Face folder: its converted checkpoint
    device = choose_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    tp_mesh = tensor_parallel_mesh(args, device)
    try:
        _serve(args, device, tp_mesh)
    finally:
        del tp_mesh
        destroy_distributed()


def _serve(args: argparse.Namespace, device: Any, tp_mesh: Any) -> None:
    model, meta = load_model(args.load, device, args.ckpt_step, tp_mesh=tp_mesh)
    check_shape_flags(args, text_config(model))  # a LLaVA model: its language model's shape
    model.to(model_dtype(args))
    tokenizer_args = fill_tokenizer_args(args, meta)
    tokenizer = build_tokenizer(tokenizer_args)
    positions = text_config(model).max_position_embeddings
    seq_len = args.inference_max_seq_length or min(positions, 4096)
    if args.inference_max_seq_length is not None and args.inference_max_seq_length < 2:
        raise SystemExit("error: --inference-max-seq-length must be at least 2")
    engine = build_engine(model, max_requests=args.inference_max_requests, max_sequence_length=seq_len,
                          group=None if tp_mesh is None else tp_mesh.get_group(), max_waiting=args.inference_max_waiting,
                          compile_forwards=args.inference_compile)
    if tp_mesh is not None and tp_mesh.get_rank() != 0:
        engine.follow()  # every step rank 0 plans, until it closes the engine
        return
    limits = ServerLimits(args.max_prompt_tokens or seq_len - 1, args.max_tokens_to_generate, args.max_batch_size,
                          args.max_request_bytes, args.request_body_timeout, args.max_pending_requests)
    ctx = make_context(engine, model, tokenizer, limits, args.model_name, log_requests=not args.quiet,
                       saved_args=meta.get("args"))
    try:
        if args.frontend_process:
            from megatrain.inference.frontend_process import FrontendProcess

            server = FrontendProcess(ctx, tokenizer_args, args.host, args.port, quiet=args.quiet)
        else:
            server = make_server(ctx, args.host, args.port, quiet=args.quiet)
    except ValueError as e:  # what --frontend-process cannot serve
        engine.close()
        raise SystemExit(f"error: --frontend-process: {e} (drop the flag)")
    except OSError as e:
        engine.close()
        raise SystemExit(f"error: cannot listen on {args.host}:{args.port} ({e.strerror})")
    host, port = server.server_address[:2]
    print(f" serving on http://{host}:{port} (PUT /api, POST /v1/completions, POST /v1/chat/completions, "
          "GET /v1/models, GET /health)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()  # closes the engine: the other ranks' follow() returns
    sys.stdout.flush()
