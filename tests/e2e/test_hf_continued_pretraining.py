"""Continued pre-training of every supported Hugging Face architecture, as a user runs it: a tiny random
model saved by transformers (no downloads) -> ``pretrain_gpt.py --load hf:DIR`` for 20 iterations on
one process and under torchrun with --tensor-model-parallel-size 2 (the same losses) -> the ``--save-hf``
copy of the TP=2 run loads in transformers, gives our logits and generates our greedy tokens.

One module per architecture family's class: GPT2LMHeadModel, LlamaForCausalLM (Llama 3.x rope scaling),
MistralForCausalLM (sliding window), Qwen2ForCausalLM (tied, q/k/v biases), Qwen3ForCausalLM (q/k
norms, free head dim), MixtralForCausalLM, Qwen2MoeForCausalLM (shared expert, dense layers),
Qwen3MoeForCausalLM.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.e2e.conftest import cpu_env, losses_and_validation, run_cmd  # noqa: E402
from tests.e2e.test_start_from_hf_dir import save_word_level_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

ITERS = 20
# No dropout (its masks differ between layouts).
SCHEDULE = ["--mock-data", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
            "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0", "--device", "cpu", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--train-iters", str(ITERS)]
LLAMA = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
             max_position_embeddings=64)
MOE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
ARCHITECTURES = {
    "gpt2": lambda v: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=v, bos_token_id=1, eos_token_id=2)),
    "llama3": lambda v: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **LLAMA, vocab_size=v, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8})),
    "mistral": lambda v: transformers.MistralForCausalLM(transformers.MistralConfig(
        **LLAMA, vocab_size=v, sliding_window=6, tie_word_embeddings=False)),
    "qwen2": lambda v: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **LLAMA, vocab_size=v, tie_word_embeddings=True)),
    "qwen3": lambda v: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **LLAMA, vocab_size=v, head_dim=16, rope_theta=1e6, tie_word_embeddings=True)),
    "mixtral": lambda v: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **MOE, num_hidden_layers=2, vocab_size=v, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False)),
    "qwen2_moe": lambda v: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **MOE, num_hidden_layers=2, vocab_size=v, intermediate_size=40, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
        tie_word_embeddings=True)),
    "qwen3_moe": lambda v: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **MOE, num_hidden_layers=2, vocab_size=v, head_dim=16, intermediate_size=40, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)),
}


def _hf_folder(path: Path, arch: str) -> Path:
    fast = save_word_level_tokenizer(path)
    torch.manual_seed(0)
    model = ARCHITECTURES[arch](len(fast))
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 3
    with torch.no_grad():  # every parameter random (norms, routers), large enough that no greedy choice is a tie
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path))
    return path


def _pretrain(folder: Path, save: Path, tp: int, *extra: str) -> str:
    launch = [sys.executable] if tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                               str(tp), "--standalone"]
    # the vocabulary padded to 128 rows in both layouts (Megatron pads to a multiple of divisor x TP)
    return run_cmd([*launch, "pretrain_gpt.py", "--load", f"hf:{folder}", *SCHEDULE, "--tensor-model-parallel-size",
                    str(tp), "--make-vocab-size-divisible-by", str(128 // tp), "--save", str(save), *extra],
                   env=cpu_env()).stdout


# qwen3_moe (experts, qk-layernorm, GQA) in every run; the other architectures are the same path
# with other adapters (each one's import/export is a unit test).
DEFAULT_RUN = ("qwen3_moe",)


@pytest.mark.parametrize("arch", [a if a in DEFAULT_RUN else pytest.param(a, marks=pytest.mark.long)
                                  for a in sorted(ARCHITECTURES)])
def test_import_train_under_tp2_equals_one_process_then_export(arch, tmp_path):
    folder = _hf_folder(tmp_path / "hf", arch)
    one = losses_and_validation(_pretrain(folder, tmp_path / "one", 1))[0]
    tp = losses_and_validation(_pretrain(folder, tmp_path / "tp2", 2, "--save-hf"))[0]
    assert len(one) == len(tp) == ITERS
    assert [loss for loss, _ in tp] == pytest.approx([loss for loss, _ in one], rel=1e-5)
    assert one[-1][0] < one[0][0]  # it learns (mock data is a repeating pattern)

    from megatrain.inference.generation import generate
    from megatrain.inference.loading import load_model

    copy = tmp_path / "tp2" / f"iter_{ITERS:07d}" / "hf"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(copy), dtype=torch.float32).eval()
    assert type(theirs).__name__ == type(ARCHITECTURES[arch](8)).__name__
    ours, _ = load_model(str(tmp_path / "tp2"), torch.device("cpu"))
    vocab = theirs.config.vocab_size
    tokens = torch.randint(4, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens)[..., :vocab] - theirs(tokens).logits).abs().max().item()
    assert diff < 1e-4, diff
    prompt = tokens[:1, :5]
    with torch.no_grad():
        expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                                   eos_token_id=None)[0, 5:].tolist()
    assert generate(ours, [prompt[0].tolist()], 6)[0] == expected


def test_several_end_ids_travel_and_stop_generation(tmp_path):
    """A chat model's generation_config.json lists more end ids than the tokenizer's eos (Llama 3
    Instruct's [<|end_of_text|>, <|eom_id|>, <|eot_id|>]): generation stops at any of them, and the
    export writes the list back."""
    import json

    from megatrain.convert.export_hf import export_checkpoint
    from megatrain.convert.import_hf import import_hf_model
    from megatrain.data.tokenizers import HuggingFaceTokenizer
    from megatrain.inference.loading import load_model
    from megatrain.inference.text_generation import SamplingParams, complete

    def run(ckpt: Path, stop: bool):
        import_hf_model(str(folder), str(ckpt))
        model, meta = load_model(str(ckpt), torch.device("cpu"))
        tokenizer = HuggingFaceTokenizer(meta["args"]["tokenizer_model"])
        params = SamplingParams(tokens_to_generate=12, greedy=True, stop_on_eod=stop)
        return tokenizer, complete(model, tokenizer, ["the cat"], params)[0]

    folder = _hf_folder(tmp_path / "hf", "llama3")
    _, free = run(tmp_path / "free", stop=False)
    end = next(t for t in free.tokens[3:] if t != 2 and t not in free.tokens[:3])  # a token it reaches later
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, end],
                                                               "temperature": 0.6}))
    tokenizer, stopped = run(tmp_path / "ckpt", stop=True)
    assert tokenizer.end_ids == [2, end]
    first = next(i for i, t in enumerate(free.tokens) if t in (2, end))
    assert stopped.tokens == free.tokens[:first + 1] and stopped.finish_reason == "stop"

    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    written = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert written["eos_token_id"] == [2, end] and written["temperature"] == 0.6
    assert transformers.GenerationConfig.from_pretrained(str(tmp_path / "out")).eos_token_id == [2, end]

    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 999]}))
    with pytest.raises(ValueError, match="eos_token_id"):
        HuggingFaceTokenizer(str(folder))
