"""T5's FlexAttention path (relative position bias as a score_mod, padding as a BlockMask) against its SDPA path.

On CPU FlexAttention runs forward only: the block masks against ``create_block_mask``, the model's
outputs against SDPA's under no_grad, and the choice of path. On CUDA (``gpu``): the loss and every
gradient, the relative position tables' included, against SDPA's, in fp32 and bf16, eager and
compiled (per layer and whole model).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import warnings

import pytest
import torch

from megatrain.models.common.flex_attention import (BLOCK_SIZE, FlexAttentionMask, flex_attention_available,
                                                    padding_block_mask)
from megatrain.models.common.layer_stacks import transformer_layers
from megatrain.models.t5 import T5Config, T5Model
from megatrain.models.t5.config import attention_backend_from_args, attention_description, uses_flex_attention

needs_flex = pytest.mark.skipif(not flex_attention_available(), reason="this torch has no flex_attention")

V = 256


def _cfg(backend: str = "sdpa", **kw) -> T5Config:
    base = dict(num_layers=2, decoder_num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16,
                ffn_hidden_size=128, vocab_size=V, max_position_embeddings=512, hidden_dropout=0.0,
                attention_dropout=0.0, position_embedding_type="relative", normalization="RMSNorm",
                add_bias_linear=False, relative_attention_num_buckets=32, relative_attention_max_distance=64,
                attention_backend=backend)
    base.update(kw)
    return T5Config(**base)


def _model(cfg: T5Config, device: str = "cpu", seed: int = 0) -> T5Model:
    """Every parameter random (the relative position tables too), so the bias matters."""
    torch.manual_seed(seed)
    model = T5Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "relative" in name else 0.05))
    return model.to(device)


def _batch(device: str, b: int = 3, s_enc: int = 200, s_dec: int = 130, seed: int = 0):
    """Token ids and padding for both stacks (lengths that cross flex's 128-token tiles), labels -100
    at padded decoder positions."""
    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(5, V, (b, s_enc), generator=g)
    dec = torch.randint(5, V, (b, s_dec), generator=g)
    enc_len = torch.tensor([s_enc, s_enc - 77, 9])[:b]
    dec_len = torch.tensor([s_dec, 5, s_dec - 40])[:b]
    enc_mask = (torch.arange(s_enc)[None] < enc_len[:, None]).long()
    dec_mask = (torch.arange(s_dec)[None] < dec_len[:, None]).long()
    labels = torch.where(dec_mask == 1, torch.randint(5, V, (b, s_dec), generator=g), -100)
    return [t.to(device) for t in (enc * enc_mask, dec * dec_mask, enc_mask, dec_mask, labels)]


# ---- the block masks ------------------------------------------------------------------------------

def _reference_block_mask(keep, q_len, k_len, causal):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, k):
        seen = keep[b, k] if keep is not None else q >= 0
        return seen & (q >= k) if causal else seen

    return create_block_mask(mask_mod, keep.shape[0] if keep is not None else 1, None, q_len, k_len, device="cpu")


@needs_flex
@pytest.mark.parametrize("q_len,k_len,causal", [(20, 20, False), (20, 20, True), (130, 130, True), (300, 300, False),
                                                (256, 256, True), (512, 512, True), (128, 512, False),
                                                (30, 300, False), (1, 1, True)])
@pytest.mark.parametrize("padding", ["none", "random", "tail", "first_tile"])
def test_block_mask_is_create_block_masks(q_len, k_len, causal, padding):
    """The tiles built from the padding vector alone are those create_block_mask finds from the
    whole [b, q, k] mask: the same partial and full tiles (in the same order), both directions."""
    if padding == "none" and not causal:
        assert padding_block_mask(None, q_len, k_len, causal=False) is None
        return
    g = torch.Generator().manual_seed(q_len * 1000 + k_len)
    b = 3
    if padding == "none":
        keep = None
    elif padding == "random":
        keep = torch.rand(b, k_len, generator=g) > 0.3
    elif padding == "tail":
        keep = torch.arange(k_len)[None] < torch.tensor([k_len, k_len // 2, max(1, k_len // 5)])[:, None]
    else:  # a whole first tile of padding but its first key
        keep = torch.ones(b, k_len, dtype=torch.bool)
        keep[:, :min(k_len, BLOCK_SIZE)] = False
        keep[:, 0] = True
    mine = padding_block_mask(keep, q_len, k_len, causal=causal, device=torch.device("cpu"))
    ref = _reference_block_mask(keep, q_len, k_len, causal)
    assert tuple(mine.shape[-2:]) == tuple(ref.shape[-2:]) == (q_len, k_len)
    for count, index in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                         ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        n, theirs_n = getattr(mine, count), getattr(ref, count).expand_as(getattr(mine, count))
        assert torch.equal(n, theirs_n), count
        ids, theirs_ids = getattr(mine, index), getattr(ref, index).expand_as(getattr(mine, index))
        used = torch.arange(ids.shape[-1]) < n[..., None]  # only the first n ids of a row are meaningful
        assert torch.equal(ids[used], theirs_ids[used]), index
    assert torch.equal(mine.to_dense(), ref.to_dense().expand_as(mine.to_dense()))


def test_distance_bias_holds_the_bias_of_every_distance():
    model = T5Model(_cfg())
    for table, q_len, k_len in ((model.encoder_relative_pos_emb, 20, 20), (model.decoder_relative_pos_emb, 130, 130),
                                (model.encoder_relative_pos_emb, 7, 300)):
        full = table(q_len, k_len, torch.device("cpu"))[0]  # [heads, q, k]
        for pad_to in (1, BLOCK_SIZE):
            bias, offset = table.distance_bias(q_len, k_len, torch.device("cpu"), pad_to=pad_to)
            assert bias.shape[0] == 4 and bias.is_contiguous()
            q = torch.arange(q_len)[:, None]
            k = torch.arange(k_len)[None, :]
            assert torch.equal(bias[:, k - q + offset], full)
            assert offset >= q_len - 1 and bias.shape[1] - offset >= k_len  # columns for every distance


# ---- the model's forward on CPU --------------------------------------------------------------------

@needs_flex
@pytest.mark.parametrize("position", ["relative", "learned_absolute"])
@pytest.mark.parametrize("lengths", [(20, 12), (200, 130)], ids=["one_tile", "two_tiles"])
def test_flex_forward_equals_sdpa_forward(position, lengths):
    """Logits and the encoder output through FlexAttention equal SDPA's (padding in both stacks)."""
    s_enc, s_dec = lengths
    cfg = _cfg("sdpa", position_embedding_type=position)
    model = _model(cfg).train()  # training mode: what "auto" picks flex for (dropout 0 here)
    enc, dec, enc_mask, dec_mask, _ = _batch("cpu", s_enc=s_enc, s_dec=s_dec)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention's "called without torch.compile" (the eager reference)
        ref_enc = model.encode(enc, enc_mask)
        ref = model(enc, dec, enc_mask, dec_mask)
        model.config = dataclasses.replace(cfg, attention_backend="flex")
        assert model.uses_flex_attention()
        got_enc = model.encode(enc, enc_mask)
        got = model(enc, dec, enc_mask, dec_mask)
    real_enc = enc_mask.bool()[..., None]
    torch.testing.assert_close(got_enc * real_enc, ref_enc * real_enc, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@needs_flex
@pytest.mark.parametrize("padded", ["neither", "encoder"])
def test_flex_forward_without_padding_masks_equals_sdpa(padded):
    """No decoder padding vector: a causal block mask of one batch row, for every row."""
    cfg = _cfg("sdpa")
    model = _model(cfg).train()
    enc, dec, enc_mask, _, _ = _batch("cpu", s_enc=140, s_dec=130)
    enc_mask = enc_mask if padded == "encoder" else None
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = model(enc, dec, enc_mask, None)
        model.config = dataclasses.replace(cfg, attention_backend="flex")
        got = model(enc, dec, enc_mask, None)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@needs_flex
def test_the_layers_get_flex_masks_built_once_per_forward(monkeypatch):
    """One FlexAttentionMask per attention kind and forward, the same object for every layer; the
    bias table is looked up per distance (no [s, s] bias)."""
    import megatrain.models.common.attention as attention

    model = _model(_cfg("flex")).eval()
    seen = []

    def spy(q, k, v, mask, **kw):
        seen.append(mask)
        assert isinstance(mask, FlexAttentionMask)
        return torch.zeros_like(q)

    monkeypatch.setattr(attention, "flex_attention_forward", spy)
    enc, dec, enc_mask, dec_mask, _ = _batch("cpu")
    with torch.no_grad():
        model(enc, dec, enc_mask, dec_mask)
    enc_self, dec_self, cross = seen[0], seen[2], seen[3]
    assert len(seen) == 2 + 2 * 2 and seen[1] is enc_self and seen[4] is dec_self and seen[5] is cross
    assert enc_self.position_bias.shape == (3, 4, 2 * 256 - 1) and cross.position_bias is None
    assert dec_self.block_mask is not None and cross.block_mask is not None


@needs_flex
@pytest.mark.parametrize("scope", ["layer", "model"])
def test_flex_masks_trace_through_compiled_layers_without_recompiling(scope):
    """Under torch.compile (dynamo and AOT autograd; the CPU inductor has no flex backward) the
    FlexAttentionMask reaches the compiled layers as data: a new batch with other padding reuses the
    compiled code, the whole model is one graph, and the outputs are the eager ones."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = _model(_cfg("flex")).train()
    batches = [_batch("cpu", seed=seed)[:4] for seed in range(2)]
    batches[1][2][0, 150:] = 0  # other encoder padding
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        refs = [model(*batch) for batch in batches]
        counter = CompileCounterWithBackend("aot_eager")
        if scope == "layer":
            for layer in transformer_layers(model):
                layer.compile(backend=counter)
        else:
            model.compile(backend=counter, fullgraph=True)
        got = [model(*batches[0])]
        frames = counter.frame_count
        got.append(model(*batches[1]))
    assert counter.frame_count == frames  # the second batch recompiled nothing
    assert frames == (1 if scope == "model" else 2)  # one graph; or the encoder's and the decoder's layer
    for out, ref in zip(got, refs):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def test_the_backend_choice():
    """auto is SDPA everywhere (measured faster on an H200); flex is asked for. Megatron's flag values map."""
    assert not uses_flex_attention("auto")  # whatever the layout and device
    assert uses_flex_attention("flex")
    assert not uses_flex_attention("sdpa")
    for flag, backend in ((None, "auto"), ("auto", "auto"), ("flash", "auto"), ("fused", "auto"),
                          ("unfused", "sdpa"), ("local", "sdpa"), ("flex", "flex")):
        assert attention_backend_from_args(argparse.Namespace(attention_backend=flag)) == backend
    assert "SDPA" in attention_description("auto", "relative", "cpu")
    assert "FlexAttention" not in attention_description("auto", "relative", "cuda")
    assert "FlexAttention" in attention_description("flex", "relative", "cuda")
    assert not T5Model(_cfg("auto")).uses_flex_attention()


def test_flex_kernel_options_from_the_environment(monkeypatch):
    """MEGATRAIN_FLEX_KERNEL_OPTIONS replaces the CUDA kernels' options; a malformed value is refused when
    the flags are read (a one-line error naming the variable), not inside the compiled step."""
    from megatrain.models.common import flex_attention as fa

    monkeypatch.delenv(fa.KERNEL_OPTIONS_ENV, raising=False)
    assert fa.cuda_kernel_options() == fa.CUDA_KERNEL_OPTIONS and fa.cuda_kernel_options() is not fa.CUDA_KERNEL_OPTIONS
    monkeypatch.setenv(fa.KERNEL_OPTIONS_ENV, '{"bwd_BLOCK_M1": 64, "bwd_num_stages": 2}')
    assert fa.cuda_kernel_options() == {"bwd_BLOCK_M1": 64, "bwd_num_stages": 2}
    assert attention_backend_from_args(argparse.Namespace(attention_backend="flex")) == "flex"
    for bad in ("{BLOCK_M: 64}", "[64]", '{"BLOCK_M": "big"}'):
        monkeypatch.setenv(fa.KERNEL_OPTIONS_ENV, bad)
        with pytest.raises(ValueError, match=fa.KERNEL_OPTIONS_ENV):
            attention_backend_from_args(argparse.Namespace(attention_backend="flex"))
        assert attention_backend_from_args(argparse.Namespace(attention_backend="auto")) == "auto"  # not read


@needs_flex
def test_flex_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="attention dropout"):
        _cfg("flex", attention_dropout=0.1)
    with pytest.raises(ValueError, match="window-size"):
        _cfg("flex", window_size=(8, 0))
    with pytest.raises(ValueError, match="attention_backend"):
        _cfg("math")


def test_pretrain_t5_notes_the_attention_path():
    from megatrain.models.t5.family import check_t5_args

    args = argparse.Namespace(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              mock_data=False, tokenizer_type="BertWordPieceCase", vocab_extra_ids=100,
                              mask_prob=0.15, short_seq_prob=0.1, tensor_model_parallel_size=1,
                              sequence_parallel=False, decoder_seq_length=128, device="cpu",
                              position_embedding_type="relative", attention_dropout=0.0, attention_backend="auto",
                              legacy_notes=[])
    check_t5_args(args)
    assert args.legacy_notes == ["note: T5 attention (attention backend auto on cpu): SDPA with the relative "
                                 "position bias and the padding as one float mask [b, heads, s, s] per stack"]


# ---- CUDA: loss and gradients --------------------------------------------------------------------

def _loss_and_grads(model: T5Model, batch, dtype: torch.dtype):
    enc, dec, enc_mask, dec_mask, labels = batch
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        per_token = model(enc, dec, enc_mask, dec_mask, labels=labels)
    loss = per_token.float().sum() / (labels != -100).sum()
    loss.backward()
    return loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad.detach().clone()
                           for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_flex
@pytest.mark.parametrize("dtype,compiled", [(torch.float32, "eager"), (torch.bfloat16, "eager"),
                                            (torch.bfloat16, "layer"), (torch.bfloat16, "model"),
                                            (torch.bfloat16, "recompute")],
                         ids=["fp32-eager", "bf16-eager", "bf16-layer-compile", "bf16-model-compile",
                              "bf16-eager-selective-recompute"])
def test_flex_loss_and_gradients_match_sdpa_on_cuda(dtype, compiled):
    """Training on CUDA: the loss and every parameter's gradient through FlexAttention
    (--attention-backend flex) match SDPA's, the relative position tables' gradients included, with
    padding in the encoder and the decoder. "eager": the model uncompiled (flex_attention compiled
    on its own); "layer" / "model": per-layer torch.compile and the whole model, as pretrain_t5.py
    compiles it (--torch-compile-scope layer / the single-GPU default); "recompute": eager with
    --recompute-granularity selective (the core attentions recomputed in the backward)."""
    torch._dynamo.reset()
    cfg = _cfg("sdpa")
    sdpa = _model(cfg, "cuda").train()
    flex = copy.deepcopy(sdpa)
    flex.config = dataclasses.replace(cfg, attention_backend="flex")
    assert flex.uses_flex_attention() and not sdpa.uses_flex_attention()
    if compiled == "recompute":
        from megatrain.parallel.recompute import RecomputeConfig, apply_activation_checkpointing

        assert apply_activation_checkpointing(flex, RecomputeConfig(granularity="selective"))
    if compiled == "layer":
        for layer in transformer_layers(flex):
            layer.compile()
    elif compiled == "model":
        flex.compile()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for seed in range(2):  # a second batch: new padding, the compiled code reused
        batch = _batch("cuda", seed=seed)
        ref_loss, ref_grads = _loss_and_grads(sdpa, batch, dtype)
        loss, grads = _loss_and_grads(flex, batch, dtype)
        assert torch.isfinite(loss)
        torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol)
        assert set(grads) == set(ref_grads)
        for name in ("encoder_relative_pos_emb.relative_attention_bias.weight",
                     "decoder_relative_pos_emb.relative_attention_bias.weight"):
            assert name in grads and ref_grads[name].abs().sum() > 0
        for name, ref in ref_grads.items():
            error = ((grads[name].float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
            assert error < tol * 2, f"{name}: relative gradient error {error:.2e}"
    torch._dynamo.reset()
