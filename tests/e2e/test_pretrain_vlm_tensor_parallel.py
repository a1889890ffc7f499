"""``pretrain_vlm.py`` under tensor (and sequence) parallelism equals one process (fp32, CPU, gloo).

A tiny LLaVA (tests/unit/test_llava_family.py's) trained by the real script: in one process and under
``torchrun --nproc-per-node 2 --tensor-model-parallel-size 2`` (with and without ``--sequence-parallel``)
the losses and gradient norms agree to 1e-5. The language model is sharded by the GPT family's plan;
the vision encoder and projector are replicated, their gradients the same on both ranks (a rank
whose ViT drifted would log other losses). A checkpoint saved under TP=2 loads in one process and
resumes with one process's losses (the checkpoint layout does not depend on the parallel layout).

The padded vocabulary must be the same in both layouts (Megatron pads to a multiple of
``--make-vocab-size-divisible-by`` x TP): 8 in one process, 4 x 2 under TP=2.
"""

from __future__ import annotations


import pytest

from tests.e2e.vlm_helpers import run_losses, same_checkpoint_parameters, same_losses
from tests.unit.test_llava_family import vlm_args, write_llava_data

TP2 = ["--tensor-model-parallel-size", "2"]


def _flags(paths: dict[str, str], tp: int) -> list[str]:
    flags = vlm_args(paths)
    i = flags.index("--make-vocab-size-divisible-by")
    flags[i + 1] = str(8 // tp)  # the same padded vocabulary in both layouts
    return flags


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (6 iterations, saved at 4) and TP=2 (the first 4 of the same 6, saved at 4)."""
    out = tmp_path_factory.mktemp("vlm_tp")
    paths = write_llava_data(out)
    one = run_losses([*_flags(paths, 1), "--train-iters", "6", "--save", str(out / "one"), "--save-interval", "4"])
    tp2 = run_losses([*_flags(paths, 2), *TP2, "--train-iters", "6", "--exit-interval", "4", "--save", str(out / "tp2"),
                "--save-interval", "4"], nproc=2)
    return {"out": out, "paths": paths, "one": one, "tp2": tp2}


def test_tensor_parallel_2_equals_one_process(runs):
    same_losses(runs["one"][:4], runs["tp2"])


def test_sequence_parallel_equals_one_process(runs):
    """The expanded sequences (text and image positions: odd lengths here) are padded to a multiple of
    the TP size for the split; the losses are one process's."""
    sp = run_losses([*_flags(runs["paths"], 2), *TP2, "--sequence-parallel", "--train-iters", "4"], nproc=2)
    same_losses(runs["one"][:4], sp)


def test_a_tensor_parallel_checkpoint_reloads_and_resumes_in_one_process(runs):
    same_checkpoint_parameters(str(runs["out"] / "one"), str(runs["out"] / "tp2"), 4)
    resumed = run_losses([*_flags(runs["paths"], 1), "--train-iters", "6", "--load", str(runs["out"] / "tp2")])
    same_losses(runs["one"][4:], resumed)


@pytest.mark.parametrize("freeze", [pytest.param(["--freeze-ViT"], id="stage2", marks=pytest.mark.long),
                                    pytest.param(["--freeze-LM", "--freeze-ViT"], id="stage1")])
def test_frozen_parts_under_sequence_parallel_equal_one_process(tmp_path, freeze):
    """Frozen parts stay frozen under TP + SP (sequence parallelism's norm styles re-create the norms'
    parameters: their ``requires_grad`` is kept), so the projector alone trains as in one process."""
    paths = write_llava_data(tmp_path)
    one = run_losses([*_flags(paths, 1), *freeze, "--train-iters", "3"])
    tp2 = run_losses([*_flags(paths, 2), *TP2, "--sequence-parallel", *freeze, "--train-iters", "3"], nproc=2)
    same_losses(one, tp2)


@pytest.mark.long
def test_tensor_and_data_parallel_equal_one_process(runs):
    """TP=2 x DP=2 (four processes), the replicated encoder's gradients averaged over the data-parallel ranks."""
    tp2dp2 = run_losses([*_flags(runs["paths"], 2), *TP2, "--sequence-parallel", "--train-iters", "4"], nproc=4)
    same_losses(runs["one"][:4], tp2dp2)


@pytest.mark.parametrize("flag", ["--context-parallel-size", "--expert-model-parallel-size"])
def test_other_layouts_stay_refused(runs, flag):
    from megatrain.training.main import parse_family_args

    with pytest.raises(SystemExit) as e:
        parse_family_args("llava", [*_flags(runs["paths"], 2), *TP2, flag, "2", "--train-iters", "1"],
                          prog="pretrain_vlm.py")
    assert str(e.value) == (f"error: {flag} > 1 is not supported for the LLaVA family (pretrain_vlm.py): it trains in "
                            "one process, data, tensor or pipeline parallel (torchrun --nproc-per-node N)")
