"""Multi-token prediction (``--mtp-num-layers``): the shifted batch fields (Megatron's ``roll_tensor``), the
gradient of the model's loss against the objective written out by hand, the per-token-loss weighting,
parameter names and initial values, evaluation without the depths, the FLOPs count and the refusals (tests/distributed/test_mtp_layouts.py: the
parallel layouts)."""

from __future__ import annotations

import math

import pytest
import torch

from megatrain.data.batch import make_batch, mtp_fields
from megatrain.models.common.moe.aux_loss import set_aux_loss_scale
from megatrain.models.gpt import GPTModel
from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt.flops import num_floating_point_operations

VOCAB = 40


def _config(**kw) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, vocab_size=VOCAB, position_embedding_type="rope",
                normalization="RMSNorm", swiglu=True, ffn_hidden_size=24, add_bias_linear=False, untie_embeddings_and_output_weights=True,
                hidden_dropout=0.0, attention_dropout=0.0, mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    return GPTConfig(**{**base, **kw})


def _roll(t: torch.Tensor) -> torch.Tensor:
    """Megatron's roll_tensor without context parallelism: torch.roll left by one, the last position 0."""
    out = torch.roll(t, shifts=-1, dims=-1)
    out[..., -1] = 0
    return out


def test_fields_are_megatrons_roll_once_per_depth():
    samples = torch.randint(1, VOCAB, (3, 11))
    batch = make_batch(samples, eod_token=5, eod_mask_loss=True, mtp_depths=3)
    tokens, labels, mask = batch.tokens, batch.labels, batch.loss_mask
    for k in range(3):
        tokens, labels, mask = _roll(tokens), _roll(labels), _roll(mask)
        assert torch.equal(batch.mtp_tokens[..., k], tokens)
        assert torch.equal(batch.mtp_labels[..., k], labels)
        assert torch.equal(batch.mtp_loss_mask[..., k], mask)
        assert torch.equal(batch.mtp_counts[:, k + 1], mask.sum(dim=1))
    assert torch.equal(batch.mtp_counts[:, 0], batch.loss_mask.sum(dim=1))


def test_context_parallel_part_keeps_the_whole_sequences_targets():
    batch = make_batch(torch.randint(0, VOCAB, (2, 9)), eod_token=None, mtp_depths=1)
    index = torch.tensor([0, 1, 6, 7])
    part = batch.context_parallel_part(index)
    assert torch.equal(part.mtp_tokens, batch.mtp_tokens.index_select(1, index))
    assert torch.equal(part.mtp_counts, batch.mtp_counts)  # the counts of the whole sequences


def _reference_objective(model: GPTModel, batch, per_token: bool) -> torch.Tensor:
    """The loss whose gradient the model's must be, written out from the description of DeepSeek-V3's and
    Megatron-LM's multi-token prediction."""
    cfg = model.config
    hidden = model.embed(batch.tokens, None)
    positions = torch.arange(batch.tokens.shape[1]).unsqueeze(0)
    from megatrain.models.common.rope import rotary_tables

    rotary = rotary_tables(cfg, positions)
    for layer in model.layers.values():
        hidden = layer(hidden, positions, None, rotary=rotary)
    hidden = model.final_layernorm(hidden)

    def masked_ce(h, labels, mask):
        ce = torch.nn.functional.cross_entropy(model.logits(h).flatten(0, 1).double(), labels.flatten(),
                                               reduction="none").view(labels.shape)
        return (ce * mask.double()).sum()

    n0 = batch.loss_mask.sum()
    main = masked_ce(hidden, batch.labels, batch.loss_mask)
    total = main if per_token else main / n0
    extra = 0.0
    for k, depth in enumerate(model.mtp.layers.values()):
        emb = model.embed(batch.mtp_tokens[..., k], None)
        mixed = depth.eh_proj(torch.cat([depth.enorm(emb), depth.hnorm(hidden)], dim=-1))
        hidden = depth.final_layernorm(depth.transformer_layer(mixed, positions, None, rotary=rotary))
        nk = batch.mtp_loss_mask[..., k].sum()
        s = masked_ce(hidden, batch.mtp_labels[..., k], batch.mtp_loss_mask[..., k])
        extra = extra + (s * n0 / nk if per_token else s / nk)
    return total + cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers * extra


@pytest.mark.parametrize("per_token", [False, True])
def test_gradient_is_the_objectives(per_token):
    torch.manual_seed(0)
    model = GPTModel(_config()).double().train()
    model.mtp.calculate_per_token_loss = per_token
    batch = make_batch(torch.randint(0, VOCAB, (2, 13)), eod_token=3, eod_mask_loss=True, mtp_depths=2)
    set_aux_loss_scale(1.0)
    per_token_loss = model(batch.tokens, labels=batch.labels, mtp_targets=batch.mtp_targets())
    main = (per_token_loss * batch.loss_mask.double()).sum()
    (main if per_token else main / batch.loss_mask.sum()).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _reference_objective(model, batch, per_token).backward()
    for name, param in model.named_parameters():  # the model's cross entropy runs in float32
        assert torch.allclose(got[name], param.grad, rtol=1e-5, atol=1e-7), name
    assert got["mtp.layers.1.eh_proj.weight"].abs().sum() > 0
    # the logged value: each depth's mean loss over its own tokens
    assert model.mtp.logged.shape == (2,) and bool((model.mtp.logged > 0).all())


def test_loss_scale_multiplies_the_depths_gradient_only():
    torch.manual_seed(1)
    model = GPTModel(_config(mtp_num_layers=1)).double().train()
    batch = make_batch(torch.randint(0, VOCAB, (2, 9)), eod_token=None, mtp_depths=1)
    grads = []
    for scale in (1.0, 4.0):
        model.zero_grad()
        set_aux_loss_scale(scale)
        loss = model(batch.tokens, labels=batch.labels, mtp_targets=batch.mtp_targets())
        (loss.sum() * scale).backward()
        grads.append(model.mtp.layers["0"].eh_proj.weight.grad.clone())
    set_aux_loss_scale(1.0)
    assert torch.allclose(grads[1], 4 * grads[0], rtol=1e-10)


def test_evaluation_runs_the_decoder_alone():
    torch.manual_seed(2)
    model = GPTModel(_config()).eval()
    batch = make_batch(torch.randint(0, VOCAB, (2, 9)), eod_token=None, mtp_depths=2)
    with_fields = model(batch.tokens, labels=batch.labels, mtp_targets=batch.mtp_targets())
    assert torch.equal(with_fields, model(batch.tokens, labels=batch.labels))
    assert model.mtp.logged is None


def test_names_kinds_and_initial_values():
    cfg = _config(init_method_std=0.05)
    model = GPTModel(cfg)
    names = {n for n, _ in model.named_parameters() if n.startswith("mtp.")}
    for k in range(2):
        for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight",
                     "transformer_layer.self_attention.linear_qkv.weight"):
            assert f"mtp.layers.{k}.{part}" in names
    depth = model.mtp.layers["0"]
    assert torch.equal(depth.enorm.weight, torch.ones(16)) and torch.equal(depth.hnorm.weight, torch.ones(16))
    assert depth.eh_proj.weight.shape == (16, 32)
    assert abs(depth.eh_proj.weight.std().item() - 0.05) < 0.01
    moe = GPTModel(_config(num_moe_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=8))
    assert type(moe.mtp.layers["1"].transformer_layer.mlp).__name__ == "MoELayer"  # the last layer's kind
    assert moe.config.num_moe_layers == 1 and moe.config.mtp_moe_layers == 2


def test_flops_count_each_depth_as_a_layer_with_its_projection_and_logits():
    B, s, h, V, D = 3, 16, 16, VOCAB, 2
    base = _config(mtp_num_layers=0)
    deeper = _config(num_layers=4, mtp_num_layers=0)  # two more layers of the same kind
    with_mtp = _config(mtp_num_layers=D)
    layers_part = num_floating_point_operations(deeper, B, s) - num_floating_point_operations(base, B, s)
    megatron_extra = 6 * B * s * D * (3 * h + 2 * h * h) + 6 * B * s * h * V * D  # norms, eh_proj; logits
    assert num_floating_point_operations(with_mtp, B, s) == pytest.approx(
        num_floating_point_operations(base, B, s) + layers_part + megatron_extra, rel=1e-12)


@pytest.mark.parametrize("kw, message", [
    (dict(position_embedding_type="learned_absolute"), "needs --position-embedding-type rope"),
    (dict(mtp_num_layers=-1), "--mtp-num-layers must be at least 0"),
    (dict(mtp_loss_scaling_factor=-0.1), "--mtp-loss-scaling-factor must be at least 0"),
])
def test_bad_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(**kw)


def test_other_families_refuse_it():
    from megatrain.models.common.config import TransformerConfig
    from megatrain.models.llava.config import LlavaConfig

    with pytest.raises(ValueError, match="built for the GPT family's decoder only"):
        TransformerConfig(position_embedding_type="rope", mtp_num_layers=1)
    with pytest.raises(ValueError, match="not for a vision-language model's"):
        LlavaConfig(language=_config())


def test_mtp_fields_of_a_fully_masked_sample_count_zero():
    tokens = torch.arange(6).view(1, 6)
    fields = mtp_fields(tokens, tokens + 1, torch.zeros(1, 6), 2)
    assert fields["mtp_counts"].tolist() == [[0.0, 0.0, 0.0]]
    assert math.isclose(fields["mtp_tokens"][0, :, 1].tolist()[-1], 0)


@pytest.mark.parametrize("untie", [True, False])
def test_bf16_chunked_loss_run_trains_the_depths(untie):
    """In bf16 with the chunked loss head the output weight (and the word embeddings) serve every depth:
    they keep autograd's accumulation (the fused head's staged buffer, saved by each use, failed the second
    use's backward: a GPU run of 2026-12-08), while the layers' linears, the depths' too, fuse."""
    from megatrain.training.arguments import parse_args
    from megatrain.training.trainer import Trainer

    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--position-embedding-type", "rope", "--mtp-num-layers", "2", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100", "--lr", "1e-3", "--train-iters", "2", "--bf16",
            "--cross-entropy-chunk-size", "8", "--num-workers", "0", "--eval-iters", "0", "--device", "cpu",
            "--no-torch-compile", *(["--untie-embeddings-and-output-weights"] if untie else [])]
    trainer = Trainer(parse_args(args))
    try:
        fusion = trainer.grad_fusion
        assert fusion is not None and len(fusion.linears) == 4 * 4  # two decoder layers and two depths
        assert all(holder is not trainer.parallelized.loss_head for holder, _ in fusion.slots)
        before = trainer.module.mtp.layers["1"].eh_proj.weight.detach().clone()
        results = [trainer.train_step() for _ in range(2)]
        assert all(math.isfinite(r.loss) for r in results)
        assert not torch.equal(before, trainer.module.mtp.layers["1"].eh_proj.weight.detach())
    finally:
        trainer.close()


def test_recomputation_wraps_the_depths_layers_too():
    from megatrain.parallel.recompute import RecomputeConfig, apply_activation_checkpointing

    full = apply_activation_checkpointing(GPTModel(_config()), RecomputeConfig("full", "block", 1))
    assert full == ["layers.0", "mtp.layers.0.transformer_layer", "mtp.layers.1.transformer_layer"]
    model = GPTModel(_config())
    selective = apply_activation_checkpointing(model, RecomputeConfig("selective", modules=("core_attn", "mlp")))
    assert "mtp.layers.1.transformer_layer.mlp" in selective
    assert "mtp.layers.1.transformer_layer.self_attention.core_attention" in selective
    names = {n for n, _ in model.named_parameters()}
    assert "mtp.layers.1.transformer_layer.mlp._checkpoint_wrapped_module.linear_fc1.weight" in names


def test_fused_linears_give_the_plain_models_gradients():
    """The gradient-accumulation fusion on the layers' linears (the depths' included; the chunked head and the
    word embeddings unfused) over three micro-batches: the plain model's gradients (float32)."""
    import copy

    from megatrain.runtime.fused_loss import ChunkedCrossEntropy
    from megatrain.runtime.grad_accumulation_fusion import GradAccumulationFusion, convert_linears

    torch.manual_seed(3)
    ref = GPTModel(_config()).train()
    fused = copy.deepcopy(ref)
    for m in (ref, fused):
        m.loss_head = ChunkedCrossEntropy(8)
    from megatrain.models.common.layer_stacks import transformer_layers

    linears = convert_linears(m for layer in transformer_layers(fused) for m in layer.modules())
    assert len(linears) == 16
    fusion = GradAccumulationFusion(linears, torch.float32, others=fused.parameters())
    batches = [make_batch(torch.randint(0, VOCAB, (2, 13)), eod_token=None, mtp_depths=2) for _ in range(3)]
    set_aux_loss_scale(1.0)
    fusion.refresh()
    for b in batches:
        ref(b.tokens, labels=b.labels, mtp_targets=b.mtp_targets()).mean().backward()
        fusion.stage()
        loss = fused(b.tokens, labels=b.labels, mtp_targets=b.mtp_targets()).mean()
        fusion.release()
        loss.backward()
        fusion.merge_held()
    for (name, a), b in zip(fused.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6 * b.grad.abs().max().item(), msg=name)


def test_repeated_layer_runs_one_depths_modules_for_every_depth():
    torch.manual_seed(4)
    cfg = _config(mtp_num_layers=3, mtp_use_repeated_layer=True)
    model = GPTModel(cfg).double().train()
    assert list(model.mtp.layers) == ["0"] and cfg.mtp_built_layers == 1
    batch = make_batch(torch.randint(0, VOCAB, (2, 11)), eod_token=None, mtp_depths=3)
    set_aux_loss_scale(1.0)
    (model(batch.tokens, labels=batch.labels, mtp_targets=batch.mtp_targets()).sum()).backward()
    assert model.mtp.logged.shape == (3,)
    # the same loss as three separate depths holding the one depth's weights
    separate = GPTModel(_config(mtp_num_layers=3)).double().train()
    state = model.state_dict()
    for k in range(3):
        for name, value in list(state.items()):
            if name.startswith("mtp.layers.0."):
                state[name.replace("mtp.layers.0.", f"mtp.layers.{k}.")] = value
    separate.load_state_dict(state)
    model.mtp.logged.zero_()
    loss_a = model(batch.tokens, labels=batch.labels, mtp_targets=batch.mtp_targets())
    loss_b = separate(batch.tokens, labels=batch.labels, mtp_targets=batch.mtp_targets())
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(model.mtp.logged, separate.mtp.logged)


def test_detached_heads_train_the_depths_alone():
    torch.manual_seed(5)
    model = GPTModel(_config(mtp_detach_heads=True)).double().train()
    plain = GPTModel(_config()).double().train()
    plain.load_state_dict(model.state_dict())
    batch = make_batch(torch.randint(0, VOCAB, (2, 11)), eod_token=None, mtp_depths=2)
    set_aux_loss_scale(1.0)
    grads = {}
    for name, m in (("detached", model), ("plain", plain)):
        loss = m(batch.tokens, labels=batch.labels, mtp_targets=batch.mtp_targets())
        (loss * batch.loss_mask.double()).sum().backward()
        grads[name] = {n: p.grad.clone() for n, p in m.named_parameters()}
    # the decoder, the embeddings and the output layer get the next-token loss's gradient only ...
    main_only = GPTModel(_config(mtp_num_layers=0)).double().train()
    main_only.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    (main_only(batch.tokens, labels=batch.labels) * batch.loss_mask.double()).sum().backward()
    for n, p in main_only.named_parameters():
        torch.testing.assert_close(grads["detached"][n], p.grad, rtol=1e-12, atol=1e-12, msg=n)
    # ... and the depths the same gradient as without detaching
    for n in grads["detached"]:
        if n.startswith("mtp."):
            torch.testing.assert_close(grads["detached"][n], grads["plain"][n], rtol=1e-9, atol=1e-12, msg=n)
    assert not torch.equal(grads["plain"]["output_layer.weight"], grads["detached"]["output_layer.weight"])
