"""A test-only model family: a tiny bidirectional encoder that classifies sequences.

It exists to prove the model-family seam: everything the trainer, pipeline, checkpoints and tensor
parallelism need comes from this folder and the one ``register`` call below, with no edit to
megatrain's trainer, pipeline or checkpoint code. Its objective has two losses (``cls loss``: the
class of the first token, ``parity loss``: the parity of the last), so multi-loss logging is
exercised too.
"""

from __future__ import annotations

from megatrain.models.common.config_checks import ConfigCheck
from megatrain.models.registry import ModelFamily, register
from tests.toy_family.model import (ToyEncoder, ToyEncoderConfig, ToyStage, initial_value, tensor_parallel_plan,
                                    toy_config_from_args, toy_flops)
from tests.toy_family.objective import ClassificationObjective

TOY = register(ModelFamily(
    name="toy",
    config_class=ToyEncoderConfig,
    config_from_args=toy_config_from_args,
    build_model=ToyEncoder,
    build_stage=ToyStage,
    initial_value=initial_value,
    tensor_parallel_plan=tensor_parallel_plan,
    objective=lambda args, tokenizer: ClassificationObjective(),
    flops=toy_flops,
    config_checks={"num_layers": ConfigCheck("compare", "--num-layers"),
                   "hidden_size": ConfigCheck("compare", "--hidden-size"),
                   "num_classes": ConfigCheck("compare", "(the toy's number of classes)")},
    description="test-only bidirectional encoder with two classification losses",
))
