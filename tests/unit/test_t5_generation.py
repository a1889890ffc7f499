"""T5 generation: incremental decoding with the KV cache equals the full decoder, greedy decoding equals
transformers' generate(do_sample=False) on the exported model token for token, tools/generate.py on a
T5 checkpoint, and the HTTP server's PUT /api and /v1/completions for T5 over real HTTP."""

from __future__ import annotations

import http.client
import json
import threading

import pytest
import torch

from megatrain.data.tokenizers import build_tokenizer
from megatrain.inference import text_generation
from megatrain.inference.seq2seq import generate_seq2seq, tokenize_with_sentinels
from megatrain.inference.server import ServerLimits, TextGenerationService, make_server
from megatrain.inference.text_generation import SamplingParams, complete
from megatrain.models.common.attention import KVCache
from tests.unit.t5_tiny import CLS, SEP, V, random_model, save, write_vocab

PROMPTS = ["the cat sat on the mat", "hello <extra_id_0> world", "a big red dog ran . <extra_id_1>"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    vocab = write_vocab(tmp_path_factory.mktemp("t5_vocab") / "vocab.txt")
    return build_tokenizer({"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": str(vocab),
                            "vocab_extra_ids": 4})


@pytest.mark.parametrize("positions", ["relative", "learned_absolute", "rope"])
def test_cached_decoding_equals_the_whole_decoder(positions):
    model = random_model("tied_swiglu", position_embedding_type=positions)
    g = torch.Generator().manual_seed(0)
    enc, dec = torch.randint(5, V, (2, 9), generator=g), torch.randint(5, V, (2, 6), generator=g)
    enc_mask = torch.ones_like(enc, dtype=torch.bool)
    enc_mask[1, 5:] = False
    with torch.no_grad():
        encoded = model.encode(enc, enc_mask)
        whole = model.decode(dec, encoded, enc_mask)
        cache = KVCache(8)
        one_by_one = torch.cat([model.decode_step(dec[:, t:t + 1], encoded, enc_mask, cache) for t in range(6)], 1)
        cache = KVCache(8)  # a block of several tokens, then the rest
        blocks = torch.cat([model.decode_step(dec[:, :4], encoded, enc_mask, cache),
                            model.decode_step(dec[:, 4:], encoded, enc_mask, cache)], 1)
    assert (one_by_one - whole).abs().max().item() < 1e-4 and (blocks - whole).abs().max().item() < 1e-4


@pytest.mark.parametrize("style", ["tied_swiglu", "untied_gelu_tanh"])
def test_greedy_equals_transformers_generate(style, tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    from megatrain.convert.export_hf import export_checkpoint

    # as many decoder as encoder layers: transformers 5's generate() sizes its cache by the encoder's count
    model = random_model(style, seed=4, decoder_num_layers=2)
    with torch.no_grad():  # a likely end token, so that some outputs stop early
        model.embedding.word_embeddings.weight[SEP] *= 3
    vocab = write_vocab(tmp_path / "vocab.txt")
    export_checkpoint(str(save(model, tmp_path / "ckpt", vocab)), str(tmp_path / "hf"), progress=False)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path / "hf")).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))

    ours = complete(model, tokenizer, PROMPTS, SamplingParams(12, greedy=True))
    batch = hf_tok(PROMPTS, add_special_tokens=False, padding=True, return_tensors="pt")  # no [CLS]/[SEP]: ours
    assert [c.prompt_tokens for c in ours] == [[t for t, m in zip(ids, mask) if m] for ids, mask in
                                               zip(batch.input_ids.tolist(), batch.attention_mask.tolist())]
    with torch.no_grad():
        theirs = hf.generate(**batch, do_sample=False, max_new_tokens=12)
    assert (theirs[:, 0] == CLS).all()  # the decoder starts with our bos
    for c, row in zip(ours, theirs.tolist()):
        want = row[1:]
        if SEP in want:
            want = want[:want.index(SEP) + 1]
        assert c.tokens == want
    assert any(c.finish_reason == "stop" for c in ours) or all(len(c.tokens) == 12 for c in ours)


def test_sampling_is_reproducible_and_stays_in_the_vocabulary(tokenizer):
    model = random_model("untied_swiglu")
    ids = [tokenize_with_sentinels(tokenizer, p) for p in PROMPTS]
    runs = [generate_seq2seq(model, ids, 10, decoder_start=CLS, greedy=False, temperature=1.5, seed=7,
                             vocab_size=V) for _ in range(2)]
    assert runs[0] == runs[1] and all(0 <= t < V for out in runs[0] for t in out)


def test_generate_tool_on_a_t5_checkpoint(tokenizer, tmp_path, capsys):
    model = random_model("tied_gelu", seed=2)
    ckpt = save(model, tmp_path / "ckpt", write_vocab(tmp_path / "vocab.txt"))
    text_generation.main(["--load", str(ckpt), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--greedy",
                          "--tokens-to-generate", "6", "--output-json", str(tmp_path / "out.json"), "--device", "cpu"])
    out = json.loads((tmp_path / "out.json").read_text())
    want = generate_seq2seq(model, [tokenize_with_sentinels(tokenizer, p) for p in PROMPTS[:2]], 6,
                            decoder_start=CLS, eod=SEP, vocab_size=V)
    assert [r["tokens"] for r in out] == want
    assert f"--- prompt: {PROMPTS[0]!r}" in capsys.readouterr().out


def _request(srv, method: str, path: str, body) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
    conn.request(method, path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    return resp.status, payload


def test_server_answers_for_t5(tokenizer):
    model = random_model("tied_swiglu", seed=5)
    service = TextGenerationService(model, tokenizer, ServerLimits(max_prompt_tokens=20, max_tokens_to_generate=8))
    srv = make_server(service, "127.0.0.1", 0, quiet=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        ids = [tokenize_with_sentinels(tokenizer, p) for p in PROMPTS[:2]]
        want = generate_seq2seq(model, ids, 5, decoder_start=CLS, eod=SEP, vocab_size=V)
        status, out = _request(srv, "PUT", "/api", {"prompts": PROMPTS[:2], "tokens_to_generate": 5, "top_k": 1,
                                                    "logprobs": True})
        assert status == 200, out
        assert out["text"] == [tokenizer.detokenize(w) for w in want]  # the decoder's output
        assert out["segments"] == [[tokenizer.detokenize([t]) for t in w] for w in want]
        assert [len(lp) for lp in out["logprobs"]] == [len(w) for w in want]
        assert all(x <= 0 for lp in out["logprobs"] for x in lp)
        status, out = _request(srv, "POST", "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 5,
                                                                "temperature": 0})
        text = tokenizer.detokenize(want[0][:-1] if want[0][-1] == SEP else want[0])
        assert status == 200 and out["choices"][0]["text"] == text, out
        status, out = _request(srv, "PUT", "/api", {"prompts": ["the " * 30], "tokens_to_generate": 2})
        assert status == 400 and "limit is 20" in out["message"]
    finally:
        srv.shutdown()
        srv.server_close()
