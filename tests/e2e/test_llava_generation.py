"""Generation from a LLaVA checkpoint with images, on CPU: a tiny random LLaVA saved by ``pretrain_vlm.py``
(one step at a negligible learning rate), PIL-made images.

``tools/generate.py --image`` (greedy, several prompts left-padded into one batch, with and without the
``<image>`` placeholder) equals a no-cache reference computed here (a full forward of the whole sequence
each step); the server (``tools/run_text_generation_server.py``) answers OpenAI's chat completions through
the real ``openai`` client with a data: URL image and ``PUT /api`` with a base64 image, the same tokens;
bad images, remote URLs and images sent to a text-only model are one-line errors / 400s."""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import TrainState
from megatrain.data.multimodal.image_processing import CLIPImageProcessor
from megatrain.data.tokenizers import TokenizerConfig, build_tokenizer
from megatrain.inference.loading import load_model
from megatrain.models.gpt import GPTModel
from megatrain.models.gpt.config import GPTConfig
from tests.e2e.conftest import cpu_env, run_cmd
from tests.unit.test_llava_family import vlm_args, write_llava_data

REPO = Path(__file__).resolve().parents[2]
GENERATE = str(REPO / "tools" / "generate.py")
SERVER = str(REPO / "tools" / "run_text_generation_server.py")
PROMPT = "what is this ?"
N = 10

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava_gen")
    paths = write_llava_data(root, n=8)
    # an identity chat template: the chat's prompt is the message's text ("<image>\n" + text)
    (Path(paths["tok"]) / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    run_cmd([sys.executable, "pretrain_vlm.py", *vlm_args(paths), "--train-iters", "1", "--lr", "1e-9", "--seed", "3",
             "--global-batch-size", "2", "--save", str(root / "ckpt"), "--save-interval", "1"], env=cpu_env())
    images = {}
    for name, size, colour in (("red", (20, 18), (200, 30, 30)), ("blue", (23, 17), (20, 30, 230))):
        images[name] = root / f"{name}.png"
        Image.new("RGB", size, colour).save(images[name])
    (root / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    model, meta = load_model(str(root / "ckpt"), torch.device("cpu"))
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=paths["tok"]))
    return {"root": root, "ckpt": str(root / "ckpt"), "images": images, "model": model, "tok": tok}


def prompt_ids(llava, prompt: str) -> list[int]:
    """The prompt's tokens, ``<image>`` (one token of this tokenizer) as the model's image token id."""
    tok, image_id = llava["tok"], llava["model"].config.image_token_id
    placeholder = tok.tokenize("<image>")[-1]
    return [image_id if t == placeholder else t for t in tok.tokenize(prompt)]


def reference(llava, prompt: str, image: Path, n: int = N) -> list[int]:
    """Greedy tokens without a KV cache: the model's full forward over prompt + generated tokens each step."""
    model, tok = llava["model"], llava["tok"]
    cfg = model.config
    ids = prompt_ids(llava, prompt)
    pixels = CLIPImageProcessor.from_pretrained(None, size=cfg.vision.img_h)(Image.open(image))[None]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([ids + out]), pixels)[0, -1].argmax())
            out.append(token)
            if token == tok.eod:
                break
    return out


def generate_cli(llava, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_cmd([sys.executable, GENERATE, "--load", llava["ckpt"], "--device", "cpu", "--greedy",
                    "--tokens-to-generate", str(N), *extra], env=cpu_env(), check=check)


def test_generate_with_an_image_equals_the_no_cache_reference(llava, tmp_path):
    out = tmp_path / "out.json"
    for name in ("red", "blue"):  # two prompts of different lengths in one batch (left padding)
        generate_cli(llava, "--image", str(llava["images"][name]), "--prompt", PROMPT,
                     "--prompt", "say it : <image> what colour ?", "--output-json", str(out))
        got = json.loads(out.read_text())
        assert got[0]["prompt"] == f"<image>\n{PROMPT}"  # no placeholder: the image goes first
        assert got[0]["tokens"] == reference(llava, f"<image>\n{PROMPT}", llava["images"][name])
        assert got[1]["tokens"] == reference(llava, "say it : <image> what colour ?", llava["images"][name])
    assert len(got[0]["tokens"]) > 1


def test_generate_image_errors_are_one_line(llava, tmp_path):
    missing = generate_cli(llava, "--image", str(tmp_path / "nope.png"), "--prompt", PROMPT, check=False)
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: --image {tmp_path / 'nope.png'}: no such file"
    corrupt = llava["root"] / "corrupt.png"
    bad = generate_cli(llava, "--image", str(corrupt), "--prompt", PROMPT, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith(f"error: --image {corrupt}: cannot read the image")
    assert len(bad.stderr.strip().splitlines()) == 1
    two = generate_cli(llava, "--image", str(llava["images"]["red"]), "--prompt", "<image> and <image>", check=False)
    assert two.returncode == 2 and "has 2 <image> placeholders for 1 images" in two.stderr
    assert "Traceback" not in two.stderr
    # a text-only checkpoint
    gpt = GPTModel(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32,
                             max_position_embeddings=32))
    checkpointing.save_checkpoint(str(tmp_path / "gpt"), TrainState(iteration=1), gpt, None, {},
                                  argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=30), gpt.config)
    text = run_cmd([sys.executable, GENERATE, "--load", str(tmp_path / "gpt"), "--device", "cpu", "--prompt", "1 2",
                    "--image", str(llava["images"]["red"])], env=cpu_env(), check=False)
    assert text.returncode == 2 and text.stderr.startswith("error: --image: the checkpoint --load") and \
        "text-only model" in text.stderr and len(text.stderr.strip().splitlines()) == 1


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def request(port: int, method: str, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(method, path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = json.loads(resp.read())
    conn.close()
    return resp.status, out


@pytest.fixture(scope="module")
def server(llava):
    proc = subprocess.Popen([sys.executable, SERVER, "--load", llava["ckpt"], "--device", "cpu", "--port", "0",
                             "--quiet", "--inference-max-requests", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=cpu_env())
    line = proc.stdout.readline()
    if "serving on http://127.0.0.1:" not in line:
        proc.kill()
        raise AssertionError(line + proc.stderr.read())
    yield int(line.split("http://127.0.0.1:")[1].split()[0])
    proc.terminate()
    proc.wait(30)


def chat(port: int, content, **kwargs):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model="megatrain", messages=[{"role": "user", "content": content}],
                                          **kwargs)


def test_server_chat_and_put_api_with_images_answer_the_generate_tokens(llava, server, tmp_path):
    out = tmp_path / "out.json"
    generate_cli(llava, "--image", str(llava["images"]["blue"]), "--prompt", PROMPT, "--output-json", str(out))
    want = json.loads(out.read_text())[0]
    answer = chat(server, [{"type": "text", "text": PROMPT},
                           {"type": "image_url", "image_url": {"url": data_url(llava["images"]["blue"])}}],
                  temperature=0, max_tokens=N, logprobs=True)
    assert answer.choices[0].message.content == want["text"]
    tokens = [llava["tok"].detokenize([t]) for t in want["tokens"] if t != llava["tok"].eod]
    assert [c.token for c in answer.choices[0].logprobs.content][:len(tokens)] == tokens
    streamed = chat(server, [{"type": "image_url", "image_url": {"url": data_url(llava["images"]["blue"])}},
                             {"type": "text", "text": PROMPT}], temperature=0, max_tokens=N, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want["text"]
    # a text-only request to the same server: the batching engine on the language model
    assert chat(server, "hello", temperature=0, max_tokens=3).choices[0].message.content is not None

    b64 = base64.b64encode(llava["images"]["blue"].read_bytes()).decode()
    status, body = request(server, "PUT", "/api", {"prompts": [PROMPT, "hello"], "images": [b64, None],
                                                   "tokens_to_generate": N, "top_k": 1})
    assert status == 200, body
    assert body["tokens"][0] == prompt_ids(llava, f"<image>\n{PROMPT}") + want["tokens"]
    ids = prompt_ids(llava, f"<image>\n{PROMPT}")
    assert ids[0] == llava["model"].config.image_token_id  # the text shows the image as <image>
    assert body["text"][0] == "<image>" + llava["tok"].detokenize(ids[1:] + want["tokens"])
    assert body["segments"][0][0] == "<image>"
    status, text_only = request(server, "PUT", "/api", {"prompts": ["hello"], "tokens_to_generate": N, "top_k": 1})
    assert status == 200 and text_only["tokens"][0] == body["tokens"][1]  # engine path = vision call's text path


@pytest.mark.parametrize("url,message", [
    ("https://example.com/cat.png", "remote images are not fetched"),
    ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"no image here").decode(), "cannot read the image"),
    ("data:image/png,rawbytes", "must be base64-encoded"),
])
def test_server_bad_image_parts_are_400_naming_the_part(server, url, message):
    status, body = request(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}], "max_tokens": 2})
    assert status == 400 and message in body["message"]
    assert body["message"].startswith("messages[0].content[1].image_url.url")
    status, body = request(server, "PUT", "/api", {"prompts": ["hi"], "images": [url], "tokens_to_generate": 2})
    assert status == 400 and message in body["message"] and body["message"].startswith("images[0]")


def test_server_refusals_with_images(server, llava):
    b64 = base64.b64encode(llava["images"]["red"].read_bytes()).decode()
    for extra, message in (({"logprobs": True}, "logprobs is not supported with images"),
                           ({"images": [b64, b64]}, "one base64 image (or null) per prompt"),
                           ({"image_path": "/etc/x.png"}, "image_path (a file on the server) is not read")):
        status, body = request(server, "PUT", "/api", {"prompts": ["hi"], "images": [b64], "tokens_to_generate": 2,
                                                       **extra})
        assert status == 400 and message in body["message"], body
    url = "data:image/png;base64," + b64
    status, body = request(server, "POST", "/v1/chat/completions", {"stream": True, "logit_bias": {"3": 1}, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})
    assert status == 400 and "logit_bias, presence_penalty and frequency_penalty are not supported with images" in \
        body["message"]
    status, body = request(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "<image> twice"}, {"type": "image_url", "image_url": {"url": url}}]}]})
    assert status == 400 and "holds 2 <image> placeholders for 1 images" in body["message"]


def test_images_to_a_text_only_model_are_400():
    from megatrain.inference.server import ServerLimits, make_server, model_context

    model = GPTModel(GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32,
                               max_position_embeddings=32))
    tok = build_tokenizer({"tokenizer_type": "NullTokenizer", "vocab_size": 30})
    srv = make_server(model_context(model, tok, ServerLimits(max_prompt_tokens=16)), "127.0.0.1", 0, quiet=True)
    srv.start()
    try:
        png = io.BytesIO()
        Image.new("RGB", (4, 4)).save(png, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        status, body = request(srv.port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]})
        assert status == 400 and "this model takes no images" in body["message"]
        status, body = request(srv.port, "PUT", "/api", {"prompts": ["1 2"], "images": [url]})
        assert status == 400 and "this model takes no images" in body["message"]
    finally:
        srv.shutdown()
        srv.server_close()
