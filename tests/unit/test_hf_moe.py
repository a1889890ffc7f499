"""Hugging Face mixture-of-experts conversion: MixtralForCausalLM, Qwen2MoeForCausalLM (gated shared expert,
dense layers by mlp_only_layers / decoder_sparse_step) and Qwen3MoeForCausalLM (q/k norms), both ways.

Tiny random models built by transformers import with its logits (fp32, < 1e-4) and greedy generations,
from transformers' per-expert files and from its fused in-memory layout; exporting gives the same
tensors back bit for bit; megatrain MoE models export with the same logits; what cannot convert
exactly is refused in one line; an imported model trains on through pretrain_gpt.py and exports
through the command line tools."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("megatrain.models.common.moe.layer")

from safetensors.torch import load_file, save_file  # noqa: E402

from megatrain import checkpoint as checkpointing  # noqa: E402
from megatrain.checkpoint import TrainState  # noqa: E402
from megatrain.convert.export_hf import export_checkpoint  # noqa: E402
from megatrain.convert.import_hf import import_hf_model  # noqa: E402
from megatrain.inference.generation import generate  # noqa: E402
from megatrain.inference.loading import load_model  # noqa: E402
from megatrain.models.common.hf_adapter import UnsupportedModelError  # noqa: E402
from megatrain.models.gpt import GPTModel  # noqa: E402
from megatrain.models.gpt.config import GPTConfig  # noqa: E402
from megatrain.models.gpt.hf import gpt_config_from_hf, hf_architecture  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VOCAB = 100
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)

HF_SOURCES = {
    # renormalised top-2 of 4 experts, every layer MoE
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_hidden_layers=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e4,
        router_aux_loss_coef=0.02, tie_word_embeddings=False, **SHAPE)),
    # shared expert with its sigmoid gate, q/k/v biases, layer 1 dense (mlp_only_layers), top-2 of 8 without
    # renormalisation (norm_topk_prob false: --moe-router-pre-softmax)
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        num_hidden_layers=3, intermediate_size=80, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=True,
        **SHAPE)),
    # every second layer MoE (decoder_sparse_step 2: layers 1 and 3), renormalised, no q/k/v biases
    "qwen2_moe_sparse_step": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        num_hidden_layers=4, intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=True, qkv_bias=False,
        tie_word_embeddings=False, **SHAPE)),
    # q/k norms with a free head dim, renormalised (Qwen3-30B-A3B's norm_topk_prob true)
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_hidden_layers=2, head_dim=24, intermediate_size=80, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, rope_theta=1e6, tie_word_embeddings=True, **SHAPE)),
    # the class's default router (no renormalisation) and a dense first layer
    "qwen3_moe_pre_softmax": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[0], norm_topk_prob=False, tie_word_embeddings=False, **SHAPE)),
}
EXPECTED = {
    "mixtral": dict(moe_layer_freq=1, moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=None,
                    moe_aux_loss_coeff=0.02),
    "qwen2_moe": dict(moe_layer_freq=[1, 0, 1], moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=48,
                      moe_shared_expert_gate=True, add_qkv_bias=True),
    "qwen2_moe_sparse_step": dict(moe_layer_freq=[0, 1, 0, 1], moe_router_pre_softmax=False, add_qkv_bias=False),
    "qwen3_moe": dict(moe_layer_freq=1, moe_router_pre_softmax=False, qk_layernorm=True, kv_channels=24),
    "qwen3_moe_pre_softmax": dict(moe_layer_freq=[0, 1, 1], moe_router_pre_softmax=True, qk_layernorm=True),
}


def _noisy(model, seed: int):
    """Every parameter random (norms and Qwen's zero-initialised routers included), so no mapping hides."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def hf_folder(path: Path, source: str):
    torch.manual_seed(5)
    model = _noisy(HF_SOURCES[source](), 6)
    model.save_pretrained(str(path))
    return model


def hf_load(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def tokens(n: int = 2, s: int = 11) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, s), generator=torch.Generator().manual_seed(1))


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return (ours[..., :VOCAB] - theirs).abs().max().item()


def hf_greedy(hf, ids: torch.Tensor, n: int) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("source", list(HF_SOURCES))
def test_import_matches_transformers_and_round_trip_is_exact(source, tmp_path):
    hf = hf_folder(tmp_path / "src", source)
    import_hf_model(str(tmp_path / "src"), str(tmp_path / "ckpt"))
    model, meta = load_model(str(tmp_path / "ckpt"), torch.device("cpu"))
    cfg = model.config
    assert meta["args"]["hf_architecture"] == hf.config.architectures[0]
    assert cfg.num_moe_experts == hf.config.num_experts and cfg.moe_router_topk == hf.config.num_experts_per_tok
    for key, value in EXPECTED[source].items():
        assert getattr(cfg, key) == value, key
    ids = tokens()
    with torch.no_grad():
        assert max_diff(model(ids), hf(ids).logits) < 1e-4
    assert generate(model, ids.tolist(), 8) == hf_greedy(hf, ids, 8)

    # the printed flags rebuild exactly this model
    from megatrain.models.gpt.config import gpt_config_from_args
    from megatrain.training.arguments import parse_args
    args = parse_args([*meta["args"]["pretrain_flags"], "--seq-length", "16", "--micro-batch-size", "1",
                       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
                       "--train-iters", "1", "--lr", "1e-3"])
    assert gpt_config_from_args(args, cfg.vocab_size) == cfg

    # export: transformers' own per-expert files back, bit for bit, and the same effective config
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "back"), progress=False)
    original = load_file(str(tmp_path / "src" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original)
    for k, v in original.items():
        assert torch.equal(back[k], v), k
    again = hf_load(tmp_path / "back")
    before, after = hf.config.to_dict(), again.config.to_dict()
    for config in (before, after):  # null (Mixtral) or absent: hidden / heads, which the export writes out
        config["head_dim"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for key in ("architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                "num_key_value_heads", "head_dim", "num_experts", "num_local_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "qkv_bias",
                "router_aux_loss_coef", "tie_word_embeddings", "rope_parameters", "sliding_window", "rms_norm_eps"):
        assert before.get(key) == after.get(key), key
    moe = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in again.model.layers]
    assert moe == [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    with torch.no_grad():
        assert max_diff(model(ids), again(ids).logits) < 1e-4


@pytest.mark.parametrize("source", ["mixtral", "qwen2_moe"])
def test_import_of_the_fused_expert_layout(source, tmp_path):
    """transformers 5 holds a layer's experts as gate_up_proj [E, 2F, h] (gate rows, then up rows) and
    down_proj [E, h, F] (Mixtral under mlp., not block_sparse_moe.): a folder saved that way imports too."""
    hf = hf_folder(tmp_path / "hf", source)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight" or
             not hf.config.tie_word_embeddings}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(src / "model.safetensors"))
    import_hf_model(str(src), str(tmp_path / "ckpt"))
    model, _ = load_model(str(tmp_path / "ckpt"), torch.device("cpu"))
    ids = tokens()
    with torch.no_grad():
        assert max_diff(model(ids), hf(ids).logits) < 1e-4


# megatrain MoE models (every parameter random) exported: the class each maps to computes the same
STYLES = {
    "mixtral": (dict(num_layers=2, ffn_hidden_size=48, num_moe_experts=4, moe_router_topk=2,
                     untie_embeddings_and_output_weights=True), "MixtralForCausalLM"),
    "qwen2_moe": (dict(num_layers=3, ffn_hidden_size=80, num_moe_experts=6, moe_router_topk=2, moe_ffn_hidden_size=24,
                       moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True, moe_layer_freq=2,
                       moe_router_pre_softmax=True, add_qkv_bias=True), "Qwen2MoeForCausalLM"),
    "qwen3_moe": (dict(num_layers=3, ffn_hidden_size=56, kv_channels=24, qk_layernorm=True, num_moe_experts=4,
                       moe_router_topk=1, moe_router_pre_softmax=True, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1],
                       window_size=(6, 0)),
                  "Qwen3MoeForCausalLM"),
}
LLAMA_STYLE = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128,
                   max_position_embeddings=64,
                   position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                   hidden_dropout=0.0, attention_dropout=0.0)


@pytest.mark.parametrize("style", list(STYLES))
def test_export_of_a_megatrain_moe_model(style, tmp_path):
    fields, architecture = STYLES[style]
    torch.manual_seed(0)
    model = _noisy(GPTModel(GPTConfig(**LLAMA_STYLE, **fields)), 1)
    checkpointing.save_checkpoint(str(tmp_path / "ckpt"), TrainState(iteration=3), model, None, {},
                                  argparse.Namespace(), model.config)
    config = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False)
    assert config["architectures"] == [architecture]
    hf = hf_load(tmp_path / "hf")
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < 1e-4
    assert generate(model, ids.tolist(), 8) == hf_greedy(hf, ids, 8)


def test_refusals():
    mixtral = {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
               "num_attention_heads": 4, "intermediate_size": 48, "vocab_size": 100, "num_local_experts": 4,
               "num_experts_per_tok": 2}
    cfg, arch = gpt_config_from_hf(mixtral, 128)
    assert arch == "MixtralForCausalLM" and cfg.num_moe_experts == 4 and cfg.norm_epsilon == 1e-5  # class defaults
    assert cfg.rotary_base == 1e6 and cfg.moe_aux_loss_coeff == 0.001
    with pytest.raises(UnsupportedModelError, match="field router_jitter_noise"):
        gpt_config_from_hf({**mixtral, "router_jitter_noise": 0.1}, 128)
    with pytest.raises(UnsupportedModelError, match="field num_experts_per_tok: 5 is not between 1 and the 4"):
        gpt_config_from_hf({**mixtral, "num_experts_per_tok": 5}, 128)
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok: 1 with renormalised"):
        gpt_config_from_hf({**mixtral, "num_experts_per_tok": 1}, 128)
    with pytest.raises(UnsupportedModelError, match="fields num_local_experts and num_experts disagree"):
        gpt_config_from_hf({**mixtral, "num_experts": 8}, 128)
    with pytest.raises(UnsupportedModelError, match="rope scaling 'yarn'"):
        gpt_config_from_hf({**mixtral, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 128)
    assert gpt_config_from_hf({**mixtral, "sliding_window": 8}, 128)[0].window_size == (7, 0)
    qwen2 = {**mixtral, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "moe_intermediate_size": 16,
             "shared_expert_intermediate_size": 32}
    del qwen2["num_local_experts"]
    cfg, _ = gpt_config_from_hf(qwen2, 128)
    assert cfg.add_qkv_bias and cfg.moe_router_pre_softmax and cfg.moe_shared_expert_gate  # the class's defaults
    with pytest.raises(UnsupportedModelError, match="field shared_expert_intermediate_size: 0"):
        gpt_config_from_hf({**qwen2, "shared_expert_intermediate_size": 0}, 128)
    with pytest.raises(UnsupportedModelError, match="leave no MoE layer"):
        gpt_config_from_hf({**qwen2, "mlp_only_layers": [0, 1]}, 128)
    with pytest.raises(UnsupportedModelError, match="use_sliding_window: true without layer_types"):
        gpt_config_from_hf({**qwen2, "use_sliding_window": True, "sliding_window": 8}, 128)
    with pytest.raises(UnsupportedModelError, match="field norm_topk_prob: expected true or false"):
        gpt_config_from_hf({**qwen2, "norm_topk_prob": "yes"}, 128)
    with pytest.raises(UnsupportedModelError, match="field mlp_bias: true is not part of Qwen2MoeForCausalLM"):
        gpt_config_from_hf({**qwen2, "mlp_bias": True}, 128)
    qwen3 = {**qwen2, "architectures": ["Qwen3MoeForCausalLM"]}
    cfg, _ = gpt_config_from_hf(qwen3, 128)
    assert cfg.qk_layernorm and cfg.kv_channels == 16 and not cfg.moe_shared_expert_intermediate_size
    assert gpt_config_from_hf({**qwen3, "use_sliding_window": True, "sliding_window": 8}, 128)[0].window_size == (7, 0)
    with pytest.raises(UnsupportedModelError, match="field attention_bias"):
        gpt_config_from_hf({**qwen3, "attention_bias": True}, 128)

    moe = dict(LLAMA_STYLE, num_layers=2, num_moe_experts=4)
    assert hf_architecture(GPTConfig(**moe)) == "MixtralForCausalLM"
    for extra, message in [
        (dict(moe_router_score_function="sigmoid"), "softmax routing"),
        (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
         "no --moe-router-enable-expert-bias"),
        (dict(moe_expert_capacity_factor=1.0), "dropless experts"),
        (dict(moe_router_topk_scaling_factor=2.0), "no --moe-router-topk-scaling-factor"),
        (dict(add_bias_linear=True), "no linear biases"),
        (dict(moe_router_pre_softmax=True), "MixtralForCausalLM, which needs top-k probabilities renormalised"),
        (dict(moe_layer_freq=2), "every layer MoE"),
        (dict(moe_shared_expert_intermediate_size=32), "it needs --moe-shared-expert-gate"),
        (dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True, qk_layernorm=True),
         "Qwen3MoeForCausalLM \\(q/k norms\\) no shared expert"),
        (dict(normalization="LayerNorm"), "which need RMSNorm"),
    ]:
        with pytest.raises(UnsupportedModelError, match=message):
            hf_architecture(GPTConfig(**{**moe, **extra}))


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.mark.long
def test_continued_pretraining_and_the_command_lines(tmp_path):
    """convert_hf_to_checkpoint.py -> pretrain_gpt.py (the printed flags, --load --finetune) for a few
    iterations under expert parallelism (torchrun, EP=2: the 8 experts 4 per rank) ->
    convert_checkpoint_to_hf.py: transformers loads the trained model with our logits."""
    hf_folder(tmp_path / "src", "qwen2_moe")
    proc = _run("tools/convert_hf_to_checkpoint.py", "--hf-path", str(tmp_path / "src"),
                "--save", str(tmp_path / "ckpt"))
    assert "converted Qwen2MoeForCausalLM" in proc.stdout
    flags = checkpointing.read_meta(checkpointing.find_checkpoint(str(tmp_path / "ckpt")))["args"]["pretrain_flags"]
    train = [*flags, "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--train-iters", "3", "--lr", "1e-3",
             "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--device", "cpu",
             "--load", str(tmp_path / "ckpt"), "--finetune", "--save", str(tmp_path / "trained")]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = _run("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                "pretrain_gpt.py", *train, "--expert-model-parallel-size", "2")
    assert proc.stdout.count("lm loss:") == 3, proc.stdout[-2000:]
    assert "experts: ep 2 x edp 1" in proc.stdout, proc.stdout[-2000:]
    proc = _run("tools/convert_checkpoint_to_hf.py", "--checkpoint-path", str(tmp_path / "trained"),
                "--output-path", str(tmp_path / "out"), "--no-progress")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Qwen2MoeForCausalLM"]
    model, _ = load_model(str(tmp_path / "trained"), torch.device("cpu"))
    original = load_file(str(tmp_path / "src" / "model.safetensors"))
    trained = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(trained) == set(original)
    assert not torch.equal(trained["model.layers.0.mlp.experts.0.gate_proj.weight"],
                           original["model.layers.0.mlp.experts.0.gate_proj.weight"])  # it did train
    ids = tokens()
    with torch.no_grad():
        assert max_diff(model(ids), hf_load(tmp_path / "out")(ids).logits) < 1e-4
