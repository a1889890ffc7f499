"""One command from a local Hugging Face folder: ``pretrain_gpt.py --load hf:DIR`` with only batch and
schedule flags trains from the folder's weights (model flags and tokenizer from the folder) and writes
``--save-hf`` copies that load in transformers with our logits; a conflicting model flag is one line;
``tools/generate.py --load DIR`` generates transformers' greedy tokens; TP=2 under torchrun starts from
the same weights (the same losses as one process).

The folders are tiny random LlamaForCausalLM / Qwen2ForCausalLM models saved by transformers, with a
WordLevel tokenizer trained offline on a few sentences.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from megatrain.convert import hf_start  # noqa: E402
from megatrain.training import finetune  # noqa: E402
from megatrain.training.arguments import parse_args  # noqa: E402
from tests.e2e.conftest import cpu_env, losses_and_validation, run_cmd  # noqa: E402

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "the bird sang a song at dawn",
             "we read books and drink tea", "she writes code in the morning", "rain falls on the green hills"]
# batch and schedule flags only: the model and the tokenizer come from the folder
SCHEDULE = ["--mock-data", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
            "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--device", "cpu"]


def save_word_level_tokenizer(path: Path):
    """A WordLevel tokenizer trained offline on SENTENCES, saved by transformers into ``path`` (ids:
    [UNK] 0, <s> 1, </s> 2, <pad> 3, then the words)."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, tokenizers.trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "<s>", "</s>", "<pad>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))
    return fast


def _hf_folder(path: Path, kind: str) -> Path:
    fast = save_word_level_tokenizer(path)
    shape = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=48, vocab_size=len(fast), max_position_embeddings=64, bos_token_id=1,
                 eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=False))
    else:  # tied, q/k/v biases
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape, tie_word_embeddings=True))
    with torch.no_grad():  # large enough weights that no greedy choice is a near-tie
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: _hf_folder(root / kind, kind) for kind in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def one_process(folders, tmp_path_factory) -> dict:
    """``pretrain_gpt.py --load hf:LLAMA ... --save OUT --save-hf`` on one process."""
    out = tmp_path_factory.mktemp("run") / "out"
    proc = run_cmd([sys.executable, "pretrain_gpt.py", "--load", f"hf:{folders['llama']}", *SCHEDULE,
                    "--train-iters", "3", "--save", str(out), "--save-hf"], env=cpu_env())
    return {"out": out, "stdout": proc.stdout, "losses": losses_and_validation(proc.stdout)[0]}


def test_pretrain_from_hf_folder_trains_and_saves_hf_copies(one_process, folders):
    stdout, out = one_process["stdout"], one_process["out"]
    assert "model flags not given come from its config.json" in stdout and "(HuggingFaceTokenizer)" in stdout
    assert "at iteration 0 (finetune" in stdout  # the folder's weights, a fresh optimizer
    assert len(one_process["losses"]) == 3 and all(0 < loss < 20 for loss, _ in one_process["losses"])
    assert [p.name for p in (out / "hf_import").iterdir()][0].startswith("llama-")  # the conversion, under --save
    assert not list((out / "hf_import").glob("*.tmp"))

    from megatrain.inference.loading import load_model

    copy = out / "iter_0000003" / "hf"
    assert "saved a Hugging Face copy" in stdout and (copy / "config.json").is_file()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(copy), dtype=torch.float32).eval()
    ours, _ = load_model(str(out), torch.device("cpu"))
    vocab = theirs.config.vocab_size
    assert vocab == json.loads((folders["llama"] / "config.json").read_text())["vocab_size"]  # the rows it came with
    tokens = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens)[..., :vocab] - theirs(tokens).logits).abs().max().item()
    assert diff < 1e-4
    assert transformers.AutoTokenizer.from_pretrained(str(copy))("the cat")["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(str(folders["llama"]))("the cat")["input_ids"]


def test_tensor_parallel_run_starts_from_the_same_weights(one_process, folders, tmp_path):
    # --pretrained-checkpoint DIR (with no checkpoint in --load) starts from it as --load hf:DIR does;
    # 64 x TP 2 pads the vocabulary to the one-process run's 128 rows, so the losses are the same.
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                    "pretrain_gpt.py", "--pretrained-checkpoint", str(folders["llama"]), *SCHEDULE,
                    "--train-iters", "3", "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64",
                    "--save", str(tmp_path / "tp")], env=cpu_env())
    assert proc.stdout.count("converting the Hugging Face folder") == 1  # rank 0 only
    losses = losses_and_validation(proc.stdout)[0]
    assert [loss for loss, _ in losses] == pytest.approx([loss for loss, _ in one_process["losses"]], rel=1e-5)


def test_generate_from_hf_folder_matches_transformers(folders, tmp_path):
    qwen = folders["qwen2"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(qwen), dtype=torch.float32).eval()
    prompt = "the cat sat on"
    # the folder's tokenizer.json itself (AutoTokenizer would take Qwen2Tokenizer's rules for a qwen2 folder)
    ids = tokenizers.Tokenizer.from_file(str(qwen / "tokenizer.json")).encode(prompt).ids
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    eos = hf.config.eos_token_id
    expected = expected[:expected.index(eos) + 1] if eos in expected else expected
    out = tmp_path / "gen.json"
    run_cmd([sys.executable, "tools/generate.py", "--load", str(qwen), "--prompt", prompt, "--greedy",
             "--tokens-to-generate", "8", "--device", "cpu", "--output-json", str(out)],
            env={**cpu_env(), hf_start.CACHE_ENV: str(tmp_path / "cache")})
    assert json.loads(out.read_text())[0]["tokens"] == expected


def _parse(*argv: str, parser=None):
    return parse_args([*SCHEDULE, "--train-iters", "1", *argv], parser=parser)


def test_model_flags_from_config_json_and_conflicts(folders, one_process):
    llama, qwen = folders["llama"], folders["qwen2"]
    args = _parse("--load", str(llama), "--num-layers", "2", "--swiglu")  # matching flags are fine
    assert (args.num_layers, args.hidden_size, args.num_query_groups, args.ffn_hidden_size) == (2, 32, 2, 48)
    assert args.position_embedding_type == "rope" and args.untie_embeddings_and_output_weights
    assert args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model == str(llama)
    args = _parse("--load", f"hf:{llama}", "--tokenizer-type", "NullTokenizer", "--vocab-size", "40")
    assert args.tokenizer_type == "NullTokenizer"  # tokenizer flags given: the folder's is not used

    # finetune_gpt.py's command line too; Qwen2: tied, q/k/v biases only
    args = _parse("--pretrained-checkpoint", str(qwen), parser=finetune.build_parser())
    assert args.add_qkv_bias and not args.add_bias_linear and not args.untie_embeddings_and_output_weights

    for flags, expected in [
            (["--hidden-size", "64"], "error: --hidden-size 64 conflicts with {}: its hidden_size is 32, i.e. "
                                      "--hidden-size 32"),
            (["--group-query-attention", "--num-query-groups", "4"], "error: --num-query-groups 4 conflicts with {}: "
                                                                     "its num_key_value_heads is 2"),
            (["--rotary-base", "5e5"], "error: --rotary-base 500000.0 conflicts with {}: its "
                                       "rope_parameters.rope_theta is 10000.0")]:
        with pytest.raises(SystemExit) as e:
            _parse("--load", f"hf:{llama}", *flags)
        message = str(e.value.code)
        assert message.startswith(expected.format(llama / "config.json")) and "\n" not in message, message
    with pytest.raises(SystemExit, match="--load hf:/nowhere: no such directory"):
        _parse("--load", "hf:/nowhere")

    # --pretrained-checkpoint with a --load that holds a checkpoint: a resume, nothing converted
    args = _parse("--pretrained-checkpoint", f"hf:{llama}", "--load", str(one_process["out"]))
    hf_start.prepare_start(args)
    assert args.pretrained_checkpoint == f"hf:{llama}" and args.load == str(one_process["out"])
