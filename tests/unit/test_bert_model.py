"""The BERT family's model, objective and checks against written-out references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatrain.models.bert import BertConfig, BertModel
from megatrain.models.bert.objective import MaskedLMObjective
from megatrain.models.bert.stage import BertStage
from megatrain.models.registry import get_family


def _cfg(**kw) -> BertConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=96, max_position_embeddings=16,
                hidden_dropout=0.0, attention_dropout=0.0, gelu_approximation="none")
    base.update(kw)
    return BertConfig(**base)


def _samples(b=3, s=16, vocab=96, seed=0, masked=4):
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(5, vocab, (b, s), generator=g)
    padding = torch.ones(b, s, dtype=torch.long)
    padding[0, 11:] = 0
    text[0, 11:] = 0
    loss_mask = torch.zeros(b, s, dtype=torch.long)
    for i in range(b):
        loss_mask[i, torch.randperm(10, generator=g)[:masked] + 1] = 1
    labels = torch.where(loss_mask == 1, torch.randint(5, vocab, (b, s), generator=g), torch.full_like(text, -1))
    types = (torch.arange(s) >= 6).long().expand(b, s).clone()
    return {"text": text, "types": types, "labels": labels, "is_random": torch.tensor([0, 1, 1])[:b],
            "padding_mask": padding, "loss_mask": loss_mask, "truncated": torch.zeros(b, dtype=torch.long)}


def _reference_losses(model: BertModel, samples) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's pretrain_bert.py loss_func, written out: the masked mean of the per-token LM loss,
    and the mean sentence-order cross entropy."""
    logits, sop = model(samples["text"], samples["padding_mask"], samples["types"])
    mask = samples["loss_mask"].float()
    per_token = F.cross_entropy(logits.flatten(0, 1), samples["labels"].clamp(min=0).flatten(), reduction="none")
    lm = (per_token.view(mask.shape) * mask).sum() / mask.sum()
    return lm, F.cross_entropy(sop, samples["is_random"])


def test_losses_equal_megatron_loss_func_with_and_without_the_gathered_head():
    torch.manual_seed(0)
    model = BertModel(_cfg())
    samples = _samples()
    want_lm, want_sop = _reference_losses(model, samples)
    for objective in (MaskedLMObjective(True), MaskedLMObjective(True, max_predictions=5)):
        batch = objective.make_batch(samples)
        assert (batch.lm_positions is None) == (objective.max_predictions is None)
        (lm_sum, lm_n), (sop_sum, sop_n) = objective.losses(objective.forward(model, batch), objective.loss_target(batch))
        assert (lm_sum / lm_n).item() == pytest.approx(want_lm.item(), rel=1e-6)
        assert (sop_sum / sop_n).item() == pytest.approx(want_sop.item(), rel=1e-6)


def test_the_gathered_head_gives_the_same_gradients():
    model = BertModel(_cfg())
    samples = _samples()
    grads = []
    for objective in (MaskedLMObjective(True), MaskedLMObjective(True, max_predictions=6)):
        model.zero_grad()
        batch = objective.make_batch(samples)
        terms = objective.losses(objective.forward(model, batch), objective.loss_target(batch))
        sum(s / n for s, n in terms).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_more_masked_positions_than_the_bound_is_an_error():
    objective = MaskedLMObjective(True, max_predictions=2)
    with pytest.raises(RuntimeError, match="more masked positions"):
        objective.make_batch(_samples(masked=4))


def test_padding_is_invisible_to_real_tokens_and_token_types_default_to_zero():
    model = BertModel(_cfg())
    samples = _samples()
    tokens, padding = samples["text"].clone(), samples["padding_mask"]
    logits, sop = model(tokens, padding, samples["types"])
    tokens[0, 11:] = 7  # other ids under the padding
    logits2, sop2 = model(tokens, padding, samples["types"])
    torch.testing.assert_close(logits[0, :11], logits2[0, :11])
    torch.testing.assert_close(sop, sop2)
    zeros = torch.zeros_like(samples["types"])
    torch.testing.assert_close(model(tokens, padding, zeros)[0], model(tokens, padding)[0])


def test_bidirectional_attention_sees_later_tokens():
    model = BertModel(_cfg())
    tokens = torch.randint(5, 96, (1, 8))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 96
    assert not torch.allclose(model(tokens)[0][0, 0], model(changed)[0][0, 0])


def test_heads_as_megatron_builds_them():
    cfg = _cfg()
    model = BertModel(cfg)
    x = torch.randn(2, 5, 32)
    h = model.final_layernorm(x)
    transformed = F.layer_norm(F.gelu(model.lm_head.dense(h)), (32,), model.lm_head.layer_norm.weight,
                               model.lm_head.layer_norm.bias, cfg.norm_epsilon)
    want = transformed @ model.embedding.word_embeddings.weight.t() + model.output_layer.bias
    sop = model.binary_head(torch.tanh(model.pooler.dense(h[:, 0])))
    logits, got_sop = model.head(x)
    torch.testing.assert_close(logits, want)
    torch.testing.assert_close(got_sop, sop)


def test_initialisation_rules_and_parameter_counts():
    cfg = _cfg(num_layers=4)
    model = BertModel(cfg)
    std = cfg.init_method_std
    assert model.output_layer.bias.abs().max() == 0 and model.output_layer.weight is None
    assert torch.all(model.lm_head.layer_norm.weight == 1) and torch.all(model.lm_head.layer_norm.bias == 0)
    for name in ("embedding.tokentype_embeddings.weight", "pooler.dense.weight", "binary_head.weight",
                 "lm_head.dense.weight"):
        assert dict(model.named_parameters())[name].std().item() == pytest.approx(std, rel=0.3), name
    proj = model.layers["0"].self_attention.linear_proj.weight
    assert proj.std().item() == pytest.approx(std / math.sqrt(2 * 4), rel=0.3)
    untied = BertModel(_cfg(untie_embeddings_and_output_weights=True))
    assert untied.output_layer.weight.shape == (96, 32)
    no_head = BertModel(_cfg(add_binary_head=False, num_tokentypes=0))
    assert no_head.pooler is None and no_head.binary_head is None and no_head.embedding.tokentype_embeddings is None
    assert model.num_parameters() - model.num_parameters(exclude_embeddings=True) == (96 + 16 + 2) * 32


def test_pipeline_stages_compose_to_the_model():
    cfg = _cfg(num_layers=4)
    torch.manual_seed(0)
    model = BertModel(cfg)
    stages = [BertStage(cfg, ids, stage_index=i, num_stages=2) for i, ids in enumerate(([0, 1], [2, 3]))]
    for stage in stages:
        stage.load_state_dict({k: v for k, v in model.state_dict().items() if k in stage.state_dict()})
    objective = MaskedLMObjective(True, max_predictions=5)
    batch = objective.make_batch(_samples())
    want = objective.forward(model, batch)
    (args0, kw0), (args1, kw1) = (objective.stage_inputs(batch, first=True, last=False),
                                  objective.stage_inputs(batch, first=False, last=True))
    hidden = stages[0](*args0, **kw0)
    torch.testing.assert_close(stages[1](hidden, **kw1), want)
    assert stages[1].tied_parameters() and stages[1].norm_duplicates()


def test_sequence_longer_than_positions_is_refused():
    with pytest.raises(ValueError, match="--max-position-embeddings"):
        BertModel(_cfg())(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("flags, message", [
    (["--mock-data"], "--mock-data: not used by BERT"),
    (["--reset-position-ids", "--eod-mask-loss"], "--reset-position-ids, --eod-mask-loss"),
    (["--mask-prob", "1.5"], "--mask-prob must be in"),
    (["--seq-length", "32", "--max-position-embeddings", "16"], "--seq-length (32) is larger than --max-position"),
])
def test_pretrain_bert_refuses_with_one_line(flags, message, tmp_path, capsys):
    from megatrain.training.main import parse_family_args

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-4", "--data-path", str(tmp_path / "x"),
            "--vocab-file", str(tmp_path / "v.txt")]
    with pytest.raises(SystemExit) as e:
        parse_family_args("bert", base + flags)
    assert message in str(e.value)


def test_the_family_is_registered_with_its_flags():
    family = get_family("bert")
    assert family.flag_defaults == {"tokenizer_type": "BertWordPieceLowerCase"}
    assert set(family.config_checks) >= {"add_binary_head", "num_tokentypes", "hidden_size"}
    cfg = _cfg()
    assert family.flops(cfg, 4, 16) == get_family("gpt").flops(cfg, 4, 16)
