"""A T5 trained by the real pretrain_t5.py (TP=2, two gloo processes) with the settings Hugging Face
can express, exported by the real tools/convert_checkpoint_to_hf.py, is the same model in
transformers: T5ForConditionalGeneration's logits equal ours within 1e-4, its greedy generate() gives
the ids and text that tools/generate.py gives on the checkpoint, and so does tools/generate.py under
torchrun --tensor-model-parallel-size 2."""

from __future__ import annotations

import json
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.e2e.bert_corpus import write_corpus  # noqa: E402
from tests.e2e.conftest import cpu_env, run_cmd  # noqa: E402

pytestmark = pytest.mark.slow

# Hugging-Face-expressible: relative positions, RMSNorm, no biases, untied output layer (T5 v1.1's
# layout; SwiGLU is "gated-silu"); as many decoder as encoder layers (transformers 5's generate() sizes
# its cache by the encoder's count); fp32 and no dropout, so that the logits compare within 1e-4.
# A wider initialisation than the default 0.02, so that after a few iterations the greedy outputs
# depend on the input (not one answer learnt for all) with margins far above rounding (~1e-2).
TRAIN = ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
         "4", "--kv-channels", "16", "--ffn-hidden-size", "128", "--encoder-seq-length", "48",
         "--decoder-seq-length", "24", "--max-position-embeddings", "64", "--position-embedding-type", "relative",
         "--relative-attention-num-buckets", "16", "--relative-attention-max-distance", "32",
         "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--swiglu",
         "--vocab-extra-ids", "10", "--tokenizer-type", "BertWordPieceLowerCase", "--init-method-std", "0.1",
         "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", "10", "--lr", "1e-3",
         "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--log-interval", "5", "--eval-iters", "0",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--tensor-model-parallel-size", "2", "--device", "cpu",
         "--num-workers", "0"]
# Encoder inputs of different lengths (so a batch is padded) with sentinels; with NEW_TOKENS some
# outputs end with [SEP], one runs to the limit.
PROMPTS = ["a dog", "the farmer feeds <extra_id_0> every day. our neighbour <extra_id_1> the market at night. "
           "<extra_id_2> watches the hills.", "the old man <extra_id_0> <extra_id_1> <extra_id_2> <extra_id_3>"]
NEW_TOKENS = 6


def _torchrun(*argv: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", *argv]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The corpus, the TP=2 checkpoint and its Hugging Face export."""
    root = tmp_path_factory.mktemp("t5_export")
    corpus = write_corpus(root, documents=120)
    ckpt, hf = root / "ckpt", root / "hf"
    run_cmd(_torchrun("pretrain_t5.py", *TRAIN, "--vocab-file", corpus["vocab"], "--data-path", corpus["data_path"],
                      "--data-cache-path", str(root / "cache"), "--save", str(ckpt)), env=cpu_env())
    run_cmd([sys.executable, "tools/convert_checkpoint_to_hf.py", "--checkpoint-path", str(ckpt), "--output-path",
             str(hf), "--no-progress"], env=cpu_env())
    return {"root": root, "ckpt": ckpt, "hf": hf}


@pytest.fixture(scope="module")
def hf_model(run):
    model = transformers.T5ForConditionalGeneration.from_pretrained(str(run["hf"]), local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(run["hf"]), local_files_only=True)
    return model, tokenizer


def test_exported_logits_match_the_checkpoint(run, hf_model):
    import argparse

    from megatrain.data.tokenizers import build_tokenizer
    from megatrain.inference.loading import fill_tokenizer_args, load_model
    from megatrain.inference.seq2seq import tokenize_with_sentinels

    hf, hf_tok = hf_model
    ours, meta = load_model(str(run["ckpt"]), torch.device("cpu"))
    assert ours.config.untie_embeddings_and_output_weights and ours.config.swiglu
    our_tok = build_tokenizer(fill_tokenizer_args(argparse.Namespace(), meta))
    for p in PROMPTS:  # the vocabulary and its sentinels travelled: the same encoder ids
        assert hf_tok(p, add_special_tokens=False).input_ids == tokenize_with_sentinels(our_tok, p), p
    enc = hf_tok(PROMPTS, add_special_tokens=False, padding=True, return_tensors="pt")
    dec = hf_tok(["<extra_id_0> the cat sees", "<extra_id_0> a small boat <extra_id_1> our", "the"],
                 add_special_tokens=False, padding=True, return_tensors="pt")
    start = torch.full((len(PROMPTS), 1), hf.config.decoder_start_token_id)
    dec_ids, dec_mask = torch.cat([start, dec.input_ids], 1), torch.cat([torch.ones_like(start), dec.attention_mask], 1)
    assert int(enc.attention_mask.min()) == 0 and int(dec_mask.min()) == 0  # padding on both sides
    with torch.no_grad():
        theirs = hf(input_ids=enc.input_ids, attention_mask=enc.attention_mask, decoder_input_ids=dec_ids,
                    decoder_attention_mask=dec_mask).logits
        mine = ours(enc.input_ids, dec_ids, enc.attention_mask, dec_mask)[..., :theirs.shape[-1]]
    real = dec_mask.bool()
    assert theirs[real].abs().max().item() > 1  # logits of a size that makes 1e-4 a tight bound
    assert (mine - theirs)[real].abs().max().item() < 1e-4


def _generate(run, name: str, tp: bool = False) -> tuple[list[dict], str]:
    """tools/generate.py's --output-json records and its printed output."""
    out = run["root"] / f"{name}.json"
    gen = ["tools/generate.py", "--load", str(run["ckpt"]), *[a for p in PROMPTS for a in ("--prompt", p)],
           "--greedy", "--tokens-to-generate", str(NEW_TOKENS), "--device", "cpu", "--output-json", str(out)]
    argv = _torchrun(*gen, "--tensor-model-parallel-size", "2") if tp else [sys.executable, *gen]
    proc = run_cmd(argv, env=cpu_env())
    assert proc.stdout.count("--- prompt:") == len(PROMPTS)  # printed once (by the first rank under TP)
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def one_process(run):
    return _generate(run, "one")


def test_greedy_generate_matches_the_generate_tool(one_process, hf_model):
    hf, hf_tok = hf_model
    batch = hf_tok(PROMPTS, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = hf.generate(**batch, do_sample=False, max_new_tokens=NEW_TOKENS)
    records, printed = one_process
    eos = hf.config.eos_token_id
    assert (theirs[:, 0] == hf.config.decoder_start_token_id).all()
    for got, row in zip(records, theirs.tolist()):
        want = row[1:]  # after the decoder start token
        if eos in want:
            want = want[:want.index(eos) + 1]
        assert got["tokens"] == want, (got, row)
        text = hf_tok.decode(want[:-1] if want[-1] == eos else want)  # the text without [SEP]
        assert got["text"] == text and f"--- prompt: {got['prompt']!r}\n{text}\n" in printed
    stopped = [r["tokens"][-1] == eos for r in records]
    assert any(stopped) and not all(stopped), records  # outputs stopped by [SEP] and by the limit
    assert len({tuple(r["tokens"]) for r in records}) == len(PROMPTS), records  # outputs that depend on the input


@pytest.mark.long
def test_tensor_parallel_generate_matches_one_process(run, one_process):
    records, printed = _generate(run, "two", tp=True)
    assert records == one_process[0]
