"""Mixture-of-experts layers (Megatron-LM's ``megatron/core/transformer/moe``), single-device code.

* :mod:`.router`: ``TopKRouter`` (scores, top-k / group-limited routing, expert bias, the balancing
  losses attached to its outputs) and ``update_expert_biases``;
* :mod:`.aux_loss`: the balancing-loss formulas and the autograd scaler that adds their gradients
  (``set_aux_loss_scale``: the factor the trainer multiplies the micro-batch loss by);
* :mod:`.metrics`: the logged balancing-loss values (per layer, averaged over MoE layers) and the
  trainer's per-iteration MoE bookkeeping;
* :mod:`.token_ops`, :mod:`.dispatcher`, :mod:`.experts`, :mod:`.layer`: token permutation and
  dropping, the local dispatcher, the grouped experts and ``MoELayer`` (the ``mlp`` of a MoE layer).

Nothing here creates process groups; parallel code sets the routers' ``reduce_group`` /
``global_group`` and swaps the dispatcher from outside. The package imports no submodule itself.
"""
