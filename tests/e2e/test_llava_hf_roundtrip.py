"""The LLaVA family's Hugging Face adapter end to end, on CPU: a tiny LLaVA (a LLaMA-style language model and
a 1-layer CLIP ViT) trained by the real ``pretrain_vlm.py`` in two stages (the projector alone with
``--freeze-LM --freeze-ViT``, then SFT from it with ``--pretrained-checkpoint``) on a LLaVA jsonl and PIL
images, exported by ``tools/convert_checkpoint_to_hf.py`` and loaded by transformers'
``LlavaForConditionalGeneration``: its greedy generation on a training image (pixel values from the
folder's ``preprocessor_config.json``, as transformers' ``LlavaProcessor`` makes them from the folder) is
``tools/generate.py --image``'s on the megatrain checkpoint; the
folder imported back (``tools/convert_hf_to_checkpoint.py``, and ``--load hf:DIR``) generates the same."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from megatrain.data.multimodal.image_processing import CLIPImageProcessor
from megatrain.data.tokenizers import TokenizerConfig, build_tokenizer
from tests.e2e.conftest import cpu_env, run_cmd
from tests.unit.test_llava_family import vlm_args, write_llava_data

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
PROMPT = "what is this ?"
N = 8
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava_hf")
    paths = write_llava_data(root, n=8)
    common = [sys.executable, "pretrain_vlm.py", *vlm_args(paths), *LLAMA, "--train-iters", "2", "--seed", "5",
              "--save-interval", "2"]
    run_cmd([*common, "--freeze-LM", "--freeze-ViT", "--save", str(root / "stage1")], env=cpu_env())
    run_cmd([*common, "--freeze-ViT", "--pretrained-checkpoint", str(root / "stage1"), "--save", str(root / "sft")],
            env=cpu_env())
    out = run_cmd([sys.executable, "tools/convert_checkpoint_to_hf.py", "--load", str(root / "sft"), "--output-path",
                   str(root / "hf"), "--no-progress"], env=cpu_env())
    assert "LlavaForConditionalGeneration" in out.stdout
    return {"root": root, "paths": paths, "image": Path(paths["images"]) / "0.png"}


def generate(load: str, image: Path, out: Path) -> list[int]:
    run_cmd([sys.executable, "tools/generate.py", "--load", load, "--device", "cpu", "--greedy", "--tokens-to-generate",
             str(N), "--image", str(image), "--prompt", PROMPT, "--output-json", str(out)], env=cpu_env())
    got = json.loads(out.read_text())[0]
    assert got["prompt"] == f"<image>\n{PROMPT}"
    return got["tokens"]


def until_end(tokens: list[int], eod: int) -> list[int]:
    return tokens[:tokens.index(eod) + 1] if eod in tokens else tokens


def test_exported_llava_generates_in_transformers_as_generate_py(trained, tmp_path):
    root, hf_dir = trained["root"], trained["root"] / "hf"
    names = {p.name for p in hf_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "preprocessor_config.json",
            "processor_config.json", "tokenizer.json", "tokenizer_config.json"} <= names, names
    config = json.loads((hf_dir / "config.json").read_text())
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                          tokenizer_model=trained["paths"]["tok"]))
    image_id = tok.tokenize("<image>")[-1]
    assert config["image_token_index"] == image_id and config["text_config"]["model_type"] == "llama"

    want = generate(str(root / "sft"), trained["image"], tmp_path / "want.json")
    assert len(want) > 1

    model = transformers.LlavaForConditionalGeneration.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    processor = CLIPImageProcessor.from_pretrained(str(hf_dir))  # the exported preprocessor_config.json
    pixels = processor(Image.open(trained["image"]))[None]
    assert torch.equal(pixels, CLIPImageProcessor.from_pretrained(None, size=16)(Image.open(trained["image"]))[None])
    ids = []
    for t in tok.tokenize(f"<image>\n{PROMPT}"):
        ids += [image_id] * config["image_seq_length"] if t == image_id else [t]
    # transformers' LlavaProcessor reads the exported processor files to the same ids and pixels
    hf_inputs = transformers.AutoProcessor.from_pretrained(str(hf_dir))(
        images=Image.open(trained["image"]), text=f"<image>\n{PROMPT}", return_tensors="pt")
    assert hf_inputs["input_ids"][0].tolist() == ids and torch.equal(hf_inputs["pixel_values"], pixels)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             pixel_values=pixels, max_new_tokens=N, do_sample=False, eos_token_id=tok.eod,
                             pad_token_id=config.get("pad_token_id") or 0)
    got = out[0, len(ids):].tolist()
    assert until_end(got, tok.eod) == until_end(want, tok.eod)

    # and back: the folder imported, and read as --load hf:DIR, generates the same tokens
    run_cmd([sys.executable, "tools/convert_hf_to_checkpoint.py", "--hf-path", str(hf_dir), "--save",
             str(root / "imported"), "--make-vocab-size-divisible-by", "8", "--no-progress"], env=cpu_env())
    assert until_end(generate(str(root / "imported"), trained["image"], tmp_path / "imp.json"), tok.eod) == \
        until_end(want, tok.eod)
    assert until_end(generate(f"hf:{hf_dir}", trained["image"], tmp_path / "hf.json"), tok.eod) == \
        until_end(want, tok.eod)


def test_export_refusals_are_one_line(trained, tmp_path):
    # a GPT-2-style language model (learned positions, LayerNorm, GELU) has no LLaVA text class
    root = trained["root"]
    run_cmd([sys.executable, "pretrain_vlm.py", *vlm_args(trained["paths"]), "--train-iters", "1", "--save",
             str(root / "gpt2"), "--save-interval", "1"], env=cpu_env())
    bad = run_cmd([sys.executable, "tools/convert_checkpoint_to_hf.py", "--load", str(root / "gpt2"), "--output-path",
                   str(tmp_path / "x"), "--no-progress"], env=cpu_env(), check=False)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "LlamaForCausalLM" in bad.stderr, bad.stderr
