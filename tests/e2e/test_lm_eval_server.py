"""lm-evaluation-harness against the server, offline: ``lm_eval --model local-completions`` on a tiny
checkpoint served by tools/run_text_generation_server.py, with two local tasks (a multiple-choice one:
loglikelihoods through echo + logprobs on token-id prompts; a generate_until one: greedy completions
with a stop string). The loglikelihoods lm-eval logs equal the model's own (a full forward)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState
from megatrain.data.tokenizers import TokenizerConfig, build_tokenizer
from megatrain.inference.generation import generate
from megatrain.models.gpt import GPTModel
from megatrain.models.gpt.config import GPTConfig
from tests.unit.test_sft import write_sft_tokenizer

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
CHOICE = [{"context": "hello", "choices": [" world", " there", " now"], "label": 0},
          {"context": "hi there", "choices": [" be brief", " bye now"], "label": 1},
          {"context": "be brief", "choices": [" hello world", " hi", " bye"], "label": 2}]
GEN = [{"context": "hello world", "answer": " hi"}, {"context": "bye now", "answer": " be"}]


def write_tasks(folder: Path) -> None:
    folder.mkdir()
    (folder / "choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHOICE))
    (folder / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GEN))
    (folder / "mt_choice.yaml").write_text(f"""task: mt_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'choice.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""")
    (folder / "mt_gen.yaml").write_text(f"""task: mt_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["bye"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
""")


def start_server(ckpt: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "run_text_generation_server.py"), "--load", str(ckpt),
                             "--port", "0", "--quiet", "--device", "cpu"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline()
    if "serving on http://127.0.0.1:" not in line:
        proc.kill()
        raise AssertionError(line + proc.stderr.read())
    return proc, int(line.split("http://127.0.0.1:")[1].split()[0])


@pytest.mark.slow
def test_lm_eval_scores_through_the_server(tmp_path):
    tok_dir = write_sft_tokenizer(tmp_path / "tok")
    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=32,
                               max_position_embeddings=32, init_method_std=0.3))
    model.init_weights(seed=3)
    model.eval()
    run_args = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir)
    checkpointing.save_checkpoint(str(tmp_path / "ckpt"), TrainState(iteration=1), model, None, {}, run_args,
                                  model.config)
    write_tasks(tmp_path / "tasks")
    proc, port = start_server(tmp_path / "ckpt")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf_home"), "TOKENIZERS_PARALLELISM": "false"}
    try:
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,tokenizer={tok_dir},"
               "model=megatrain,max_length=32,num_concurrent=2", "--tasks", "mt_choice,mt_gen", "--include_path",
               str(tmp_path / "tasks"), "--output_path", str(tmp_path / "out"), "--log_samples", "--batch_size", "1"]
        run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    samples = {p.name.split("_")[1] + "_" + p.name.split("_")[2]: p for p in (tmp_path / "out").rglob("samples_*.jsonl")}
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    choice_rows = [json.loads(line) for line in samples["mt_choice"].read_text().splitlines()]
    assert len(choice_rows) == len(CHOICE)
    for row in choice_rows:
        for args, resp in zip(row["arguments"].values(), row["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]  # lm-eval's target delimiter included
            context_ids = hf(context).input_ids  # lm-eval's _encode_pair: the pair encoded whole, then split
            cont_ids = hf(context + continuation).input_ids[len(context_ids):]
            seq = context_ids + cont_ids
            with torch.no_grad():
                logp = model(torch.tensor([seq[:-1]])).float().log_softmax(-1)[0]
            want = logp[len(context_ids) - 1:].gather(-1, torch.tensor(cont_ids)[:, None]).sum().item()
            assert float(resp[0][0]) == pytest.approx(want, abs=1e-4)
    gen_rows = [json.loads(line) for line in samples["mt_gen"].read_text().splitlines()]
    assert len(gen_rows) == len(GEN)
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok_dir))
    for row in gen_rows:  # greedy, 4 tokens, cut before the first stop string ("bye", or the eos token's text)
        new = generate(model, [hf(row["arguments"]["gen_args_0"]["arg_0"]).input_ids], 4, eod=tok.eod)[0]
        text = tok.detokenize([t for t in new if t != tok.eod])
        for stop in ("bye", "</s>"):
            text = text.split(stop)[0]
        assert row["resps"][0][0] == text
