"""make_batch against a loop transcription of Megatron's get_ltor_masks_and_position_ids."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatrain.data.batch import make_batch


def megatron_reference(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Loop form of Megatron's function; returns its mask with True = masked out."""
    b, s = data.shape
    att_b = b if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_b, s, s))).view(att_b, 1, s, s)
    loss_mask = torch.ones((b, s))
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    position_ids = torch.arange(s).unsqueeze(0).repeat(b, 1)
    if reset_position_ids or reset_attention_mask:
        for bi in range(b):
            eod_index = [int(i) for i in torch.arange(s)[data[bi] == eod]]
            prev = 0
            for i in eod_index:
                if reset_attention_mask:
                    attention_mask[bi, 0, (i + 1):, :(i + 1)] = 0
                if reset_position_ids:
                    position_ids[bi, (i + 1):] -= i + 1 - prev
                    prev = i + 1
    return attention_mask < 0.5, loss_mask, position_ids


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
def test_matches_megatron(flags):
    reset_pos, reset_att, mask_loss = flags
    g = torch.Generator().manual_seed(0)
    eod = 0
    samples = torch.randint(0, 4, (3, 17), generator=g)  # many EODs, incl. first/last positions
    samples[0, 0] = eod
    samples[1, -2] = eod
    out = make_batch(samples, eod, reset_pos, reset_att, mask_loss)
    ref_mask, ref_loss, ref_pos = megatron_reference(samples[:, :-1], eod, reset_pos, reset_att, mask_loss)
    assert torch.equal(out.tokens, samples[:, :-1]) and torch.equal(out.labels, samples[:, 1:])
    assert out.loss_mask.dtype == torch.float32 and torch.equal(out.loss_mask, ref_loss)
    assert torch.equal(out.position_ids, ref_pos)
    if reset_att:
        assert out.attention_mask.dtype == torch.bool and out.attention_mask.shape == (3, 1, 16, 16)
        assert torch.equal(out.attention_mask, ~ref_mask)  # ours: True = may attend
    else:
        assert out.attention_mask is None


def test_bad_shape():
    with pytest.raises(ValueError, match="batch, seq_length"):
        make_batch(torch.zeros(5, dtype=torch.long), 0)


def test_typed_batches_move_concatenate_and_refuse_context_parallelism_they_cannot_split():
    import dataclasses

    from megatrain.data.batch import CausalLMBatch, MaskedLMBatch, Seq2SeqBatch
    from megatrain.parallel.context_parallel import split_batch

    b, s = 2, 8
    masked = MaskedLMBatch(torch.ones(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long),
                           torch.ones(b, s, dtype=torch.long), torch.ones(b, s), torch.ones(b, s, dtype=torch.bool),
                           sentence_order=torch.tensor([0, 1]))
    both = MaskedLMBatch.cat([masked, masked.to(torch.device("cpu"))])
    assert both.tokens.shape == (4, s) and both.sentence_order.tolist() == [0, 1, 0, 1] and both.images is None
    assert both.seq_length == s
    seq2seq = Seq2SeqBatch(torch.ones(b, 6, dtype=torch.long), torch.ones(b, 6, dtype=torch.bool),
                           torch.ones(b, s, dtype=torch.long), torch.ones(b, s, dtype=torch.long), torch.ones(b, s),
                           torch.ones(b, s, dtype=torch.bool))
    assert Seq2SeqBatch.cat([seq2seq, seq2seq]).encoder_tokens.shape == (4, 6)
    for batch in (masked, seq2seq):
        with pytest.raises(ValueError, match=f"--context-parallel-size > 1 does not support {type(batch).__name__}"):
            split_batch(batch, 2, 0)
    causal = make_batch(torch.arange(2 * 9).view(2, 9), None)
    assert torch.equal(CausalLMBatch.cat([causal, causal]).labels[2:], causal.labels)
    assert dataclasses.replace(causal, attention_mask=None).attention_mask is None
