"""Megatron-LM checkpoints in and out (``--load`` of a Megatron checkpoint, ``tools/checkpoint/convert.py``).

* `pickles`: the allowlisted readers of Megatron's ``.pt`` pickles and ``torch_dist`` ``.metadata``;
* `names`: Megatron's parameter names and layouts (fused QKV, SwiGLU halves, TP split dims) and the
  mapping to megatrain's GPT model;
* `args`: Megatron's stored ``args`` <-> megatrain's GPT config;
* `reader`: torch_dist and legacy torch checkpoints into canonical tensors; `writer`: back out;
* `optim`: Adam's state in megatron-core's torch_dist layout (model-space keys), read and written;
  `legacy_optim`: in the legacy files (by parameter index, megatron-core's parameter order), and the
  fp16 loss scaler's state;
* `bridge`: Megatron checkpoint <-> megatrain checkpoint; `start`: ``--load DIR`` of a training run;
* `cli`: ``tools/checkpoint/convert.py`` with Megatron's command line.
"""
