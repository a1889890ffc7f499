"""Optional fp8 matmuls for the transformer layers (``--fp8-format``), through torchao's float8 training.

:func:`convert_to_fp8` swaps the ``nn.Linear`` modules of the transformer layers (QKV, attention
output, MLP in and out) for torchao's ``Float8Linear``: in every forward and backward the inputs,
weights and output gradients are cast to fp8 with a scale computed from each tensor's current
absolute maximum (dynamic, per-tensor scaling), the three matmuls run in fp8 with higher-precision
accumulation, and everything else (norms, attention, softmax, the output layer, the optimizer and
its fp32 master weights) stays as it was. The weights remain ordinary parameters under the same
names, so checkpoints, conversion to Hugging Face and generation do not see a difference.

``--fp8-format hybrid`` (Megatron's name) uses e4m3 for the forward operands and e5m2, with its
wider range, for the gradients; ``e4m3`` uses e4m3 everywhere. The output layer (vocabulary
projection) stays in bf16, as is usual, and so does any linear layer whose sizes are not
multiples of 16 (the fp8 matmul kernels need them).

Under tensor parallelism (``tp`` > 1) a layer is converted only when its local shard keeps those
sizes; :mod:`megatrain.parallel.tensor_parallel` shards the converted layers with the same styles
as plain ones, so their weights are DTensors and each scale comes from the whole tensor.

torchao is an optional dependency: ``pip install 'megatrain[fp8]'``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatrain.runtime.fp8_fusion import fits_fp8_matmuls

__all__ = ["FP8_FORMATS", "Fp8Config", "convert_to_fp8", "fp8_available", "fp8_layer_linears", "require_fp8",
           "is_fp8_linear"]

FP8_FORMATS = ("e4m3", "hybrid")
_LAYER_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def fp8_available() -> bool:
    """Whether torchao's float8 training can be imported."""
    import importlib.util

    try:
        return importlib.util.find_spec("torchao.float8") is not None
    except ImportError:  # torchao itself is missing
        return False


def require_fp8() -> None:
    """Raise ValueError naming ``--fp8-format`` when torchao's float8 training is not installed."""
    if not fp8_available():
        raise ValueError("--fp8-format needs torchao (float8 training), which is not installed: "
                         "pip install 'megatrain[fp8]'")


def is_fp8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an fp8 linear layer (torchao's, or :mod:`megatrain.runtime.fp8_fusion`'s)."""
    return type(module).__name__ in ("Float8Linear", "Fp8FusedLinear")


@dataclass(frozen=True)
class Fp8Config:
    format: str = "hybrid"  # --fp8-format

    def __post_init__(self) -> None:
        if self.format not in FP8_FORMATS:
            raise ValueError(f"--fp8-format must be one of {', '.join(FP8_FORMATS)}, got {self.format!r}")


def _torchao_config(cfg: Fp8Config):
    from torchao.float8 import CastConfig, Float8LinearConfig, ScalingGranularity, ScalingType

    def cast(dtype: torch.dtype) -> CastConfig:
        return CastConfig(scaling_type=ScalingType.DYNAMIC, scaling_granularity=ScalingGranularity.TENSORWISE,
                          target_dtype=dtype)

    grad_dtype = torch.float8_e5m2 if cfg.format == "hybrid" else torch.float8_e4m3fn
    return Float8LinearConfig(cast_config_input=cast(torch.float8_e4m3fn),
                              cast_config_weight=cast(torch.float8_e4m3fn),
                              cast_config_grad_output=cast(grad_dtype))


_COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")  # output features sharded under TP; the others: input


def _eligible(module: nn.Module, name: str, tp: int = 1) -> bool:
    """A transformer layer's linear layer whose sizes (and, under TP, local shard sizes) the fp8
    kernels take."""
    leaf = name.rsplit(".", 1)[-1]
    if not (type(module) is nn.Linear and leaf in _LAYER_LINEARS and ".layers." in f".{name}"):
        return False
    local_in, local_out = module.in_features, module.out_features
    if leaf in _COLUMN_PARALLEL:
        local_out //= tp
    else:
        local_in //= tp
    return fits_fp8_matmuls(module.in_features, module.out_features, local_in, local_out)


def convert_to_fp8(model: nn.Module, cfg: Fp8Config, tp: int = 1) -> tuple[list[str], list[str]]:
    """Swap the eligible linear layers of ``model`` (plain or on the meta device) in place; ``tp``
    is the tensor-parallel size the model will be sharded with.

    Returns (converted module names, transformer-layer linear names left in higher precision).
    """
    require_fp8()
    from torchao.float8 import convert_to_float8_training

    report = fp8_layer_linears(model, tp)
    convert_to_float8_training(model, module_filter_fn=lambda m, name: _eligible(m, name, tp),
                               config=_torchao_config(cfg))
    return report


def fp8_layer_linears(model: nn.Module, tp: int = 1) -> tuple[list[str], list[str]]:
    """(the transformer-layer linear layers of ``model`` fp8 matmuls take, those they do not)."""
    candidates = [name for name, m in model.named_modules()
                  if type(m) is nn.Linear and name.rsplit(".", 1)[-1] in _LAYER_LINEARS]
    converted = [name for name, m in model.named_modules() if _eligible(m, name, tp)]
    return converted, [name for name in candidates if name not in converted]
