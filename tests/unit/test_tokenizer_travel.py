"""Tokenizers and chat templates through Hugging Face conversion: a folder's own ``tokenizer.json``,
special tokens and chat template give megatrain transformers' ids (plain text, with and without
special tokens; ``apply_chat_template`` with and without the generation prompt), fine-tuning chats
use that template, the export gives ``AutoTokenizer`` the same again, and a template reaching for
Python internals is refused in one line with nothing run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from megatrain import checkpoint as checkpointing  # noqa: E402
from megatrain.convert import import_hf  # noqa: E402
from megatrain.convert.export_hf import export_checkpoint  # noqa: E402
from megatrain.convert.import_hf import import_hf_model  # noqa: E402
from megatrain.convert.tokenizer_files import import_hf_tokenizer, write_hf_tokenizer  # noqa: E402
from megatrain.data.sft_dataset import SFTConfig, tokenize_example  # noqa: E402
from megatrain.data.tokenizers import build_tokenizer  # noqa: E402
from megatrain.data.tokenizers.chat_template import ChatTemplateError, render_chat  # noqa: E402

SENTENCES = ["The cat sat on the mat.", "Hello world, how are you today?", "Paris is the capital of France.",
             "You are a helpful assistant.", "What is two plus two? Four.", "Be terse, answer in one word."]

# A Llama-3 style template: BOS, role headers, <|eot_id|>, an optional system message.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{%- if system_message %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('roles must alternate user/assistant') }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n")

# A ChatML (Qwen2.5) style template with a default system message; the assistant's text is marked with
# {% generation %} so that transformers' assistant mask can check the loss targets.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

STYLES = {
    "llama3": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>"],
                   bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|end_of_text|>", template=LLAMA3_TEMPLATE,
                   where="jinja"),
    "chatml": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>",
                   pad="<|endoftext|>", template=CHATML_TEMPLATE, where="config"),
}

CHATS = [
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "user", "content": "Hello, how are you?"}],
    [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."},
     {"role": "user", "content": "And the cat?"}, {"role": "assistant", "content": "It sat on the mat."}],
]

TEXTS = ["Hello world", "The cat sat on the mat.\n\nParis? 42", "  leading spaces and ünïcödé",
         "a <|im_end|> and <|eot_id|> inside text"]


def _tokenizer(style: dict) -> "transformers.PreTrainedTokenizerFast":
    """A byte-level BPE trained on a few sentences, with the style's special tokens and template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(
        vocab_size=320, special_tokens=style["specials"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if style["bos"] is not None:  # Llama 3: the post-processor puts BOS before a text
        bos = style["bos"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=style["bos"], eos_token=style["eos"],
                                                pad_token=style["pad"], chat_template=style["template"])


def _hf_folder(path: Path, name: str) -> "transformers.PreTrainedTokenizerFast":
    style = STYLES[name]
    tok = _tokenizer(style)
    tok.save_pretrained(str(path))
    if style["where"] == "config":  # the template inside tokenizer_config.json (transformers 4's layout)
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = (path / "chat_template.jinja").read_text()
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        (path / "chat_template.jinja").unlink()
    small = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=40, vocab_size=len(tok), max_position_embeddings=64,
                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**small)) if name == "llama3"
             else transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small, tie_word_embeddings=True)))
    model.save_pretrained(str(path))
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _ids(ref, messages, add_generation_prompt):
    out = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _same_ids(ours, ref) -> None:
    for text in TEXTS:
        assert ours.tokenize(text) == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
    for chat in CHATS:
        for prompt in (False, True):
            assert ours.render_chat(chat, prompt) == ref.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=prompt)
            assert ours.apply_chat_template(chat, prompt) == _ids(ref, chat, prompt)
    assert ours.bos == ref.bos_token_id and ours.eod == ref.eos_token_id and ours.pad == ref.pad_token_id


@pytest.mark.parametrize("name", sorted(STYLES))
def test_tokenizer_and_chat_template_travel_both_ways(name, tmp_path):
    src, save, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "out"
    ref = _hf_folder(src, name)
    import_hf_model(str(src), str(save))
    args = checkpointing.read_meta(checkpointing.find_checkpoint(str(save)))["args"]
    assert args["tokenizer_type"] == "HuggingFaceTokenizer"
    ours = build_tokenizer(args)
    assert ours.chat_template == STYLES[name]["template"]
    _same_ids(ours, ref)

    # fine-tuning on chat jsonl: the template's ids; the loss on what the assistant wrote
    config = SFTConfig(seq_length=64)
    for chat in (CHATS[0], CHATS[2]):
        example = tokenize_example({"messages": chat}, ours, config)
        assert example.tokens == _ids(ref, chat, False)
        trained = [t for t, keep in zip(example.tokens, example.targets) if keep]
        end = "<|eot_id|>" if name == "llama3" else "<|im_end|>"
        answers = [m["content"] + end for m in chat if m["role"] == "assistant"]
        assert ours.detokenize(trained) == "".join(answers)
        if name == "chatml":  # {% generation %} blocks: transformers' own assistant mask
            mask = ref.apply_chat_template(chat, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)["assistant_masks"]
            assert [bool(m) for m in mask] == example.targets

    export_checkpoint(str(save), str(out), progress=False)
    assert (out / "chat_template.jinja").exists() == (STYLES[name]["where"] == "jinja")
    back = transformers.AutoTokenizer.from_pretrained(str(out))
    _same_ids(ours, back)
    config_json = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    for key, value in (("bos_token_id", back.bos_token_id), ("eos_token_id", back.eos_token_id),
                       ("pad_token_id", back.pad_token_id)):
        assert config_json.get(key) == value, key
        assert generation.get(key) == value, key


def test_special_tokens_the_file_lacks_and_other_template_files(tmp_path):
    """Named tokens missing from tokenizer.json are appended as transformers appends them; a template
    only a processor's chat_template.json holds is used, and exported where AutoTokenizer reads it."""
    src = tmp_path / "src"
    tok = _tokenizer(STYLES["chatml"])
    tok.save_pretrained(str(src))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(pad_token="<pad>", extra_special_tokens=["<tool>"], image_token="<img>")
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / "chat_template.json").write_text(json.dumps({"chat_template": (src / "chat_template.jinja").read_text()}))
    (src / "chat_template.jinja").unlink()
    ref = transformers.AutoTokenizer.from_pretrained(str(src))
    tok_args = import_hf_tokenizer(str(src), str(tmp_path / "tok"), "Qwen2ForCausalLM")
    ours = build_tokenizer(tok_args)
    assert ours.vocab_size == len(ref) and ours.pad == ref.pad_token_id
    text = "x<pad>y<tool><img> hello"
    assert ours.tokenize(text) == ref.encode(text)
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.chat_template is not None and ref.chat_template is None  # AutoTokenizer skips chat_template.json

    out = tmp_path / "out"
    out.mkdir()
    write_hf_tokenizer(tok_args, str(out), 64, tokenizer=ours)
    back = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (out / "chat_template.jinja").read_text() == ours.chat_template
    for chat in CHATS:
        assert ours.apply_chat_template(chat, True) == _ids(back, chat, True)
    assert ours.tokenize(text) == back.encode(text)


HOSTILE = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{% for m in messages %}{{ m.content.__class__.__base__.__subclasses__() }}{% endfor %}",
    "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}{{ ns }}",
    "{{ range(10 ** 9) | list | length }}",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_hostile_templates_are_refused_in_one_line(template, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="refused") as e:
        render_chat(template, chat)
    assert "\n" not in str(e.value)

    src = tmp_path / "src"
    ref = _hf_folder(src, "llama3")
    (src / "chat_template.jinja").write_text(template)
    with pytest.raises(ValueError, match="refused"):
        build_tokenizer({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(src)}).apply_chat_template(
            chat, True)
    capsys.readouterr()  # what building the folder printed
    with pytest.raises(SystemExit) as exit_info:  # the import command: one line, no traceback
        import_hf.main(["--hf-path", str(src), "--save", str(tmp_path / "ckpt")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "refused" in err and "\n" not in err and "Traceback" not in err
    assert str(src / "chat_template.jinja") in err
    assert not (tmp_path / "MARKER").exists() and not os.path.exists(tmp_path / "ckpt" / "iter_0000000")
    del ref


def test_template_syntax_and_runtime_errors_are_one_line():
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(LLAMA3_TEMPLATE, [{"role": "assistant", "content": "x"}], special_tokens={"bos_token": "<s>"})


# Qwen3's habit: an empty reasoning block only on the assistant turns after the last user message.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_turns_rendered_differently_later_still_get_their_loss(tmp_path):
    tok = _tokenizer({**STYLES["chatml"], "template": THINKING_TEMPLATE})
    tok.save_pretrained(str(tmp_path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = build_tokenizer({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tmp_path)})
    example = tokenize_example({"messages": CHATS[2]}, ours, SFTConfig(seq_length=64))
    assert example.tokens == _ids(ref, CHATS[2], False)
    trained = ours.detokenize([t for t, keep in zip(example.tokens, example.targets) if keep])
    # the earlier turn as the conversation shows it (no reasoning block), the last with its empty one
    assert trained == "Four.<|im_end|>\n<think>\n\n</think>\n\nIt sat on the mat.<|im_end|>\n"
