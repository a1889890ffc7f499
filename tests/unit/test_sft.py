"""Megatron's SFT (``pretrain_gpt.py --sft --tokenizer-type SFTTokenizer``): the prompt formats render
Megatron's strings and ids, the targets cover the assistant's tokens only, one jsonl line packs into
one sample (cut, padded, several conversations kept apart), and bad input is one line naming the file
and line.

The expectations are written out from Megatron-LM's ``megatron/core/tokenizers/text/libraries/
sft_tokenizer.py`` (its three custom chat templates, ``tokenize_conversation``) and
``megatron/training/datasets/sft_dataset.py`` (``_split_conversations``, ``__getitem__``), and the
templates are also rendered by transformers' ``apply_chat_template`` when it is installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatrain.data.batch import CausalLMBatch
from megatrain.data.config import DataConfig
from megatrain.data.loader import collate_samples
from megatrain.data.sft_conversations import build_conversation_datasets
from megatrain.data.sft_dataset import sft_batch
from megatrain.data.tokenizers import SFTTokenizer, TokenizerConfig, build_tokenizer

# The test vocabulary: a word-level tokenizer whose pieces are words, single whitespace characters
# and punctuation, so that every id below can be read off the text.
WORDS = ["<unk>", "</s>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>", "\n", " ",
         "System", "User", "Assistant", "hello", "world", "hi", "there", "be", "brief", "bye", "now", "/", "think"]
UNK, EOS, S10, S11, S12, S233, NL, SP = range(8)
SYSTEM, USER, ASSISTANT, HELLO, WORLD, HI, THERE, BE, BRIEF, BYE, NOW, SLASH, THINK = range(8, 21)
I = -100  # Megatron's IGNORE_INDEX


def write_sft_tokenizer(folder: Path, chat_template: str | None = None) -> str:
    """A Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json, and ``chat_template``
    when given) of :data:`WORDS`, built offline with the ``tokenizers`` library."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s"), behavior="isolated"),
                                                 pre_tokenizers.Punctuation(behavior="isolated")])
    tok.add_special_tokens(WORDS[:6])
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import transformers
    except ImportError:  # the same files, written by hand
        tok.save(str(folder / "tokenizer.json"))
        config = {"eos_token": "</s>", "unk_token": "<unk>"}
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {**config, "chat_template": chat_template} if chat_template else config))
    else:
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
        if chat_template:
            hf.chat_template = chat_template
        hf.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    return write_sft_tokenizer(tmp_path_factory.mktemp("sft_tok"))


def sft_tokenizer(tok_dir: str, prompt_format: str) -> SFTTokenizer:
    return build_tokenizer(TokenizerConfig(tokenizer_type="SFTTokenizer", tokenizer_model=tok_dir,
                                           sft_tokenizer_prompt_format=prompt_format))


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


CHAT = [{"role": "system", "content": "be brief /think"},
        {"role": "user", "content": " hello world\n"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "bye now"}]

# (format, rendered text, token ids, targets, pad id): Megatron's templates written out.
EXPECTED = {
    "nemotron-h-aligned": (
        "<SPECIAL_10>System\nbe brief /think\n"
        "<SPECIAL_11>User\nhello world\n<SPECIAL_11>Assistant\n"
        "hi there\n"
        "<SPECIAL_11>User\nbye\n<SPECIAL_11>Assistant\n"
        "bye now\n",
        [S10, SYSTEM, NL, BE, SP, BRIEF, SP, SLASH, THINK, NL,
         S11, USER, NL, HELLO, SP, WORLD, NL, S11, ASSISTANT, NL,
         HI, SP, THERE, NL,
         S11, USER, NL, BYE, NL, S11, ASSISTANT, NL,
         BYE, SP, NOW, NL],
        [I] * 20 + [HI, SP, THERE, NL] + [I] * 8 + [BYE, SP, NOW, NL],
        S233),
    "nemotron-nano-v2": (
        "<SPECIAL_10>System\nbe brief\n"
        "<SPECIAL_11>User\nhello world\n"
        "<SPECIAL_11>Assistant\nhi there\n<SPECIAL_12>\n"
        "<SPECIAL_11>User\nbye\n"
        "<SPECIAL_11>Assistant\nbye now\n<SPECIAL_12>\n",
        [S10, SYSTEM, NL, BE, SP, BRIEF, NL,
         S11, USER, NL, HELLO, SP, WORLD, NL,
         S11, ASSISTANT, NL, HI, SP, THERE, NL, S12, NL,
         S11, USER, NL, BYE, NL,
         S11, ASSISTANT, NL, BYE, SP, NOW, NL, S12, NL],
        # the assistant header (3 tokens) carries no loss
        [I] * 14 + [I, I, I, HI, SP, THERE, NL, S12, NL] + [I] * 5 + [I, I, I, BYE, SP, NOW, NL, S12, NL],
        UNK),
}

# Megatron's chat templates as its source has them (for transformers' apply_chat_template).
MEGATRON_TEMPLATES = {
    "nemotron-h-aligned": "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<SPECIAL_10>System\n' + message['content'].strip() + '\n' }}{% elif message['role'] == 'user' %}{{ '<SPECIAL_11>User\n' + message['content'].strip() + '\n' + '<SPECIAL_11>Assistant\n' }}{% elif message['role'] == 'assistant' %}{{ message['content'].strip() + '\n' }}{% endif %}{% endfor %}",  # noqa: E501
    "nemotron-nano-v2": "{% for message in messages %}{% set content = message['content'] %}{% if message['role'] == 'system' %}{{ '<SPECIAL_10>System\n' + content.replace('/think', '').replace('/no_think', '').strip() + '\n' }}{% elif message['role'] == 'user' %}{{ '<SPECIAL_11>User\n' + content.replace('/think', '').replace('/no_think', '').strip() + '\n' }}{% elif message['role'] == 'assistant' %}{{ '<SPECIAL_11>Assistant\n' + content.strip() + '\n<SPECIAL_12>\n' }}{% endif %}{% endfor %}",  # noqa: E501
    "identity": "{% for message in messages %}{{ message['content'] }}{% endfor %}",
}


@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_nemotron_formats_render_megatrons_text_ids_and_targets(tok_dir, fmt):
    text, ids, targets, pad = EXPECTED[fmt]
    tok = sft_tokenizer(tok_dir, fmt)
    assert tok.prompt_format.render(CHAT) == text
    tokens, got_targets = tok.tokenize_conversation(CHAT)
    assert tokens.tolist() == ids and got_targets.tolist() == targets
    assert tok.pad == pad and tok.eod == EOS and tok.vocab_size == len(WORDS)
    assert tok.tokenize("hello world") == [HELLO, SP, WORLD]  # plain text as HuggingFaceTokenizer


def test_identity_format_concatenates_contents(tok_dir):
    tok = sft_tokenizer(tok_dir, "identity")
    chat = [{"role": "user", "content": "hello world\n"}, {"role": "assistant", "content": "hi there\n"},
            {"role": "tool", "content": "bye\n"}, {"role": "assistant", "content": " now"}]
    assert tok.prompt_format.render(chat) == "hello world\nhi there\nbye\n now"
    tokens, targets = tok.tokenize_conversation(chat)
    assert tokens.tolist() == [HELLO, SP, WORLD, NL, HI, SP, THERE, NL, BYE, NL, SP, NOW]
    assert targets.tolist() == [I, I, I, I, HI, SP, THERE, NL, I, I, SP, NOW]
    assert tok.pad == UNK
    # "hello" + "world" tokenize as one unknown word together but as two words apart: no mask can be placed
    with pytest.raises(ValueError, match=r"message 0 \(user\) does not tokenize on its own"):
        tok.tokenize_conversation([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}])


@pytest.mark.parametrize("fmt", sorted(MEGATRON_TEMPLATES))
def test_ids_equal_transformers_apply_chat_template(tok_dir, fmt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    chat = CHAT if fmt != "identity" else [{"role": "user", "content": "hello world\n"},
                                           {"role": "assistant", "content": "hi there"}]
    want = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=False,
                                  chat_template=MEGATRON_TEMPLATES[fmt], return_dict=False)
    assert sft_tokenizer(tok_dir, fmt).tokenize_conversation(chat)[0].tolist() == list(want)


# A chat template of the tokenizer's own, for Megatron's "default" format.
OWN_TEMPLATE = "{% for m in messages %}{{ '<SPECIAL_11>' + m['role'] | capitalize + '\n' + m['content'] + eos_token + '\n' }}{% endfor %}"  # noqa: E501


def test_default_format_renders_the_tokenizers_template_and_trains_on_every_token(tmp_path, tok_dir):
    own = write_sft_tokenizer(tmp_path / "own", chat_template=OWN_TEMPLATE)
    tok = sft_tokenizer(own, "default")
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    ids = [S11, USER, NL, HELLO, EOS, NL, S11, ASSISTANT, NL, HI, EOS, NL]
    tokens, targets = tok.tokenize_conversation(chat)
    assert tokens.tolist() == ids and targets.tolist() == ids  # Megatron masks nothing in this format
    assert tok.pad == EOS  # no pad_token: the eos token pads
    transformers = pytest.importorskip("transformers")
    want = transformers.AutoTokenizer.from_pretrained(own).apply_chat_template(chat, return_dict=False)
    assert list(want) == ids
    # In a sample the labels equal to the pad id (here every eos) carry no loss, as in Megatron.
    (train, _, _) = build_conversation_datasets(DataConfig(data_path=[write_jsonl(tmp_path / "c.jsonl", [
        {"messages": chat}])], split="100,0,0"), tok, 16, [1, 0, 0])
    assert train[0]["targets"].tolist() == [1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1] + [0] * 5
    with pytest.raises(ValueError, match=r"--sft-tokenizer-prompt-format default renders conversations with the "
                                         r"tokenizer's own chat template, which --tokenizer-model .* does not have"):
        sft_tokenizer(tok_dir, "default")


def test_unknown_prompt_format_is_one_line_naming_the_flag(tok_dir):
    with pytest.raises(ValueError) as e:
        sft_tokenizer(tok_dir, "chatml")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--sft-tokenizer-prompt-format 'chatml' is not a prompt format")
    assert msg.endswith("supported: nemotron-h-aligned, nemotron-nano-v2, identity, default")


def test_a_missing_pad_token_names_the_format(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={"hello": 0, "</s>": 1}))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"nemotron-h-aligned pads with <SPECIAL_233>, which the tokenizer"):
        sft_tokenizer(str(tmp_path), "nemotron-h-aligned")


# ---- samples: one jsonl line -> one packed sample -------------------------------------------------

SHORT = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
# two conversations: a new one starts at each system message
TWO = {"messages": [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "bye"},
                    {"role": "system", "content": "be"}, {"role": "user", "content": "hello"},
                    {"role": "assistant", "content": "hi"}]}
# nemotron-h-aligned tokens and targets of their conversations
SHORT_TOKENS = [S11, USER, NL, HELLO, NL, S11, ASSISTANT, NL, HI, NL]  # 10
SHORT_TARGETS = [I] * 8 + [HI, NL]
TWO_1 = [S10, SYSTEM, NL, BE, NL, S11, USER, NL, HI, NL, S11, ASSISTANT, NL, BYE, NL]  # 15
TWO_1_TARGETS = [I] * 13 + [BYE, NL]
TWO_2 = [S10, SYSTEM, NL, BE, NL, S11, USER, NL, HELLO, NL, S11, ASSISTANT, NL, HI, NL]  # 15
TWO_2_TARGETS = [I] * 13 + [HI, NL]
PAD = S233


def megatron_sample(tokens: list[int], targets: list[int], seq_length: int) -> dict[str, list]:
    """Megatron's tokens / labels / loss_mask of a packed line, from its written-out pack."""
    assert len(tokens) == len(targets) == seq_length + 1
    labels = targets[1:]
    return {"tokens": tokens[:-1], "labels": labels, "loss_mask": [float(x not in (PAD, I)) for x in labels]}


def _datasets(tmp_path, tok_dir, rows, seq_length, split="100,0,0", num_samples=(4, 0, 0), fmt="nemotron-h-aligned"):
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = DataConfig(data_path=[path], split=split)
    return build_conversation_datasets(cfg, sft_tokenizer(tok_dir, fmt), seq_length, list(num_samples))


def _check_against_megatron(batch: CausalLMBatch, row: int, want: dict[str, list]) -> None:
    assert batch.tokens[row].tolist() == want["tokens"]
    assert batch.loss_mask[row].tolist() == want["loss_mask"]
    keep = batch.loss_mask[row].bool()
    # our labels are the next tokens; where the loss counts they are Megatron's labels
    assert batch.labels[row][keep].tolist() == [x for x, m in zip(want["labels"], want["loss_mask"]) if m]


def test_a_short_line_is_padded_and_the_loss_is_on_the_assistant_tokens(tmp_path, tok_dir):
    train, valid, test = _datasets(tmp_path, tok_dir, [SHORT], seq_length=16)
    assert valid is None and test is None and len(train) == 4
    sample = train[0]
    assert sample["tokens"].tolist() == SHORT_TOKENS + [PAD] * 7
    batch = sft_batch(collate_samples([sample]))
    _check_against_megatron(batch, 0, megatron_sample(SHORT_TOKENS + [PAD] * 7, SHORT_TARGETS + [PAD] * 7, 16))
    assert batch.loss_mask[0].tolist() == [0.0] * 7 + [1.0, 1.0] + [0.0] * 7  # labels "hi", "\n"
    assert batch.position_ids[0].tolist() == list(range(16))  # the padding continues the conversation
    assert batch.attention_mask is None  # one conversation per row: causal attention


def test_two_conversations_in_a_line_are_packed_apart(tmp_path, tok_dir):
    (train, _, _) = _datasets(tmp_path, tok_dir, [TWO], seq_length=32)
    tokens = TWO_1 + TWO_2 + [PAD] * 3
    sample = train[0]
    assert sample["tokens"].tolist() == tokens
    assert sample["segments"].tolist() == [1] * 15 + [2] * 18  # Megatron's cu_seqlens [0, 15, 32]
    batch = sft_batch(collate_samples([sample]))
    _check_against_megatron(batch, 0, megatron_sample(tokens, TWO_1_TARGETS + TWO_2_TARGETS + [PAD] * 3, 32))
    assert torch.nonzero(batch.loss_mask[0]).flatten().tolist() == [12, 13, 27, 28]
    assert batch.position_ids[0].tolist() == list(range(15)) + list(range(17))
    mask = batch.attention_mask[0, 0]
    assert mask[20, 15] and mask[20, 20] and not mask[20, 14] and not mask[20, 21] and mask[14, 0]


def test_a_long_line_is_cut_to_seq_length_plus_a_pad(tmp_path, tok_dir):
    with pytest.warns(UserWarning, match=r"1 of 2 lines have --seq-length \+ 1 \(17\) tokens or more and are cut"):
        (train, _, _) = _datasets(tmp_path, tok_dir, [TWO, SHORT], seq_length=16)
    # Megatron: the first conversation (15 tokens) fits, the second brings the pack to 30 >= 17: it is cut
    # to 16 tokens and one pad (the second conversation keeps its first token), cu_seqlens [0, 15, 16].
    tokens = TWO_1 + [S10] + [PAD]
    targets = TWO_1_TARGETS + [I] + [PAD]
    sample = train[0]
    assert sample["tokens"].tolist() == tokens and sample["segments"].tolist()[:16] == [1] * 15 + [2]
    batch = sft_batch(collate_samples([sample, train[1]]))
    _check_against_megatron(batch, 0, megatron_sample(tokens, targets, 16))
    assert batch.loss_mask[0].tolist() == [0.0] * 12 + [1.0, 1.0, 0.0, 0.0]
    assert batch.position_ids[0].tolist() == list(range(15)) + [0]
    _check_against_megatron(batch, 1, megatron_sample(SHORT_TOKENS + [PAD] * 7, SHORT_TARGETS + [PAD] * 7, 16))
    assert batch.attention_mask is not None and batch.attention_mask[1, 0].equal(torch.ones(16, 16).tril().bool())


def test_samples_cycle_through_the_split_in_file_order(tmp_path, tok_dir):
    rows = [SHORT, TWO, SHORT, TWO]
    train, valid, _ = _datasets(tmp_path, tok_dir, rows, seq_length=32, split="50,50,0", num_samples=(5, 3, 0))
    assert len(train) == 5 and len(valid) == 3
    firsts = [train[i]["tokens"][0] for i in range(5)]
    assert firsts == [S11, S10, S11, S10, S11]  # lines 0, 1, 0, 1, 0 (no shuffling, as Megatron)
    assert [valid[i]["tokens"][0] for i in range(3)] == [S11, S10, S11]  # lines 2, 3, 2


def test_a_weighted_blend_of_two_files(tmp_path, tok_dir):
    a = write_jsonl(tmp_path / "a.jsonl", [SHORT])
    b = write_jsonl(tmp_path / "b.jsonl", [TWO])
    cfg = DataConfig(data_path=["3", a, "1", b], split="100,0,0")
    train, _, _ = build_conversation_datasets(cfg, sft_tokenizer(tok_dir, "nemotron-h-aligned"), 32, [8, 0, 0])
    firsts = [int(train[i]["tokens"][0]) for i in range(len(train))]
    assert len(train) == 8 and firsts.count(S11) == 6 and firsts.count(S10) == 2


def test_the_nano_v2_format_masks_the_assistant_header(tmp_path, tok_dir):
    (train, _, _) = _datasets(tmp_path, tok_dir, [SHORT], seq_length=16, fmt="nemotron-nano-v2")
    # <SPECIAL_11>User\nhello\n <SPECIAL_11>Assistant\n (no loss) hi\n<SPECIAL_12>\n, padded with <unk>
    tokens = [S11, USER, NL, HELLO, NL, S11, ASSISTANT, NL, HI, NL, S12, NL] + [UNK] * 5
    sample = train[0]
    assert sample["tokens"].tolist() == tokens
    assert sample["targets"].tolist() == [0] * 8 + [1] * 4 + [0] * 5


# ---- bad input: one line naming the file and line ------------------------------------------------

@pytest.mark.parametrize("line, reason", [
    ('{"messages": [', r"chat\.jsonl:2: not valid JSON"),
    ('["a list"]', r"chat\.jsonl:2: expected a JSON object with \"messages\""),
    ('{"conversation": []}', r"chat\.jsonl:2: no \"messages\" list"),
    ('{"messages": []}', r"chat\.jsonl:2: \"messages\" must be a non-empty list"),
    ('{"messages": [{"role": "user", "content": 3}]}', r"chat\.jsonl:2: message 0 must be an object with string"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}',
     r"chat\.jsonl:2: message 1 has the unknown role 'bot'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', r"chat\.jsonl:2: the conversation has no assistant message"),
    (json.dumps({"messages": TWO["messages"][:3] + TWO["messages"][3:5]}),
     r"chat\.jsonl:2: conversation 2 of 2 \(a new one starts at each system message\) has no assistant message"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}',
     r"chat\.jsonl:2: message 1 is an empty assistant message"),
    ('{"messages": [{"role": "system", "content": "be"}, {"role": "assistant", "content": "hi"}]}',
     r"chat\.jsonl:2: message 1 \(assistant\) does not follow a user or tool message"),
])
def test_bad_lines_are_one_line_naming_file_and_line(tmp_path, tok_dir, line, reason):
    with pytest.raises(ValueError, match=reason) as e:
        _datasets(tmp_path, tok_dir, [SHORT, line, SHORT], seq_length=16)
    assert "\n" not in str(e.value) and str(e.value).startswith("--data-path ")


def test_a_line_the_format_cannot_mask_names_the_line_and_conversation(tmp_path, tok_dir):
    merged = {"messages": [{"role": "system", "content": "be\n"}, {"role": "user", "content": "hi\n"},
                           {"role": "assistant", "content": "bye\n"},
                           {"role": "system", "content": "be\n"}, {"role": "user", "content": "hello"},
                           {"role": "assistant", "content": "world"}]}
    with pytest.raises(ValueError, match=r"chat\.jsonl:3: conversation 2 of 2: message 1 \(user\) does not "
                                         r"tokenize on its own .* identity"):
        fine = {"messages": [{"role": "user", "content": "hello\n"}, {"role": "assistant", "content": "hi\n"}]}
        _datasets(tmp_path, tok_dir, [fine, fine, merged], seq_length=16, fmt="identity")


def test_mixed_masks_survive_concatenation():
    """The pipeline runs an iteration's micro-batches as one: a causal micro-batch next to a packed one
    gets its causal mask."""
    def batch(mask):
        t = torch.zeros(1, 4, dtype=torch.long)
        return CausalLMBatch(t, t, t.float(), t, mask)
    packed = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    packed[0, 0, 3, :3] = False
    whole = CausalLMBatch.cat([batch(None), batch(packed)])
    assert whole.attention_mask.shape == (2, 1, 4, 4)
    assert whole.attention_mask[0, 0].equal(torch.ones(4, 4, dtype=torch.bool).tril())
    assert whole.attention_mask[1].equal(packed[0])
    assert CausalLMBatch.cat([batch(None), batch(None)]).attention_mask is None


# ---- the command line ---------------------------------------------------------------------------

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer-type", "HuggingFaceTokenizer"], "pretrain_gpt.py --sft reads Megatron's SFT conversations, which "
                                                   "need --tokenizer-type SFTTokenizer"),
    (["--tokenizer-type", "SFTTokenizer", "--mock-data"], "--sft cannot be used with --mock-data"),
    (["--tokenizer-type", "SFTTokenizer", "--reset-attention-mask"],
     "--sft cannot be used with --reset-attention-mask"),
    (["--tokenizer-type", "SFTTokenizer", "--context-parallel-size", "2"],
     "--sft cannot be used with --context-parallel-size > 1"),
])
def test_pretrain_gpt_refuses_what_megatrons_sft_dataset_does_not_take(tok_dir, flags, message, tmp_path,
                                                                       monkeypatch):
    from megatrain.training.main import main

    monkeypatch.setenv("WORLD_SIZE", "2")  # the flags are checked for two processes (nothing starts)

    data = write_jsonl(tmp_path / "d.jsonl", [SHORT])
    with pytest.raises(SystemExit) as e:
        main([*MODEL, "--sft", "--tokenizer-model", tok_dir, "--data-path", data, *flags])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_other_families_refuse_sft(tok_dir, tmp_path):
    from megatrain.training.main import main_bert

    with pytest.raises(SystemExit) as e:
        main_bert([*MODEL, "--sft", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", tok_dir,
                   "--data-path", str(tmp_path / "d.jsonl")])
    assert "use pretrain_gpt.py" in str(e.value)


@pytest.mark.filterwarnings("ignore:.*tokens or more and are cut")
def test_sample_arrays_are_int64_and_of_seq_length_plus_one(tmp_path, tok_dir):
    (train, _, _) = _datasets(tmp_path, tok_dir, [SHORT, TWO], seq_length=8)
    for i in range(len(train)):
        s = train[i]
        assert set(s) == {"tokens", "targets", "segments"}
        assert all(v.dtype == np.int64 and v.shape == (9,) for v in s.values())
