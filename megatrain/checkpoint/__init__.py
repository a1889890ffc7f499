"""Checkpoints in Megatron's directory layout, tensors stored with PyTorch distributed checkpoint (DCP).

Layout (guide §3.5)::

    SAVE/latest_checkpointed_iteration.txt     iteration number of the newest complete checkpoint
    SAVE/iter_0000100/                         one checkpoint
        .metadata, __*_*.distcp                DCP shards: model and optimizer state (global shapes)
        meta.json                              format version, iteration, consumed samples, scheduler,
                                               loss scaler, model family and config, layout, args
        rng_rank00000.pt                       RNG states of each rank (tensors only; weights_only)
        complete_rank00000.json                per-rank completeness marker: the files the rank
                                               wrote, their sizes and checksums; written last

The modules, each owning one part (none imports ``megatrain.training``; a model family is read
only through ``megatrain.models.registry``):

* `state`: `TrainState` and the RNG states; `meta`: ``meta.json``, the format versions and the
  reader of older ones; `layout`: paths, the tracker, completeness, `find_checkpoint`;
* `save`: `Checkpointer` (async, retention), `save_checkpoint`; `load`: `load_checkpoint`,
  `restore_rng`, `resume_vocab_size`; `compat`: the family and config comparison; `strictness`:
  ``--dist-ckpt-strictness``, the tensors only the model or only the checkpoint has;
* `integrity` (markers, checksums, NaN/Inf), `safe_pickle` and `dcp_reader` (the only readers
  of pickles), `save_lock` (the ``--save`` lock), `errors`; `info`: ``tools/checkpoint_info.py``.

The names below are the package's interface; callers import them from here.
"""

from megatrain.checkpoint.errors import CheckpointError, CheckpointSaveError
from megatrain.checkpoint.state import TrainState, optim_options, rng_state, set_rng_state
from megatrain.checkpoint.meta import (FORMAT_VERSION, META, build_meta, checkpoint_family, checkpoint_model_config,
                                       read_meta)
from megatrain.checkpoint.layout import (DCP_METADATA, TRACKER, checkpoint_dir, checkpoint_problem, find_checkpoint,
                                         is_complete, iterations_in)
from megatrain.checkpoint.safe_pickle import read_dcp_metadata
from megatrain.checkpoint.compat import config_differences, config_warnings, family_problem
from megatrain.checkpoint.save import Checkpointer, SaveReport, save_checkpoint
from megatrain.checkpoint.load import compare_model, load_checkpoint, model_shapes, restore_rng, resume_vocab_size
from megatrain.checkpoint.strictness import DEFAULT_STRICTNESS, STRICTNESS_MODES

__all__ = ["CheckpointError", "CheckpointSaveError", "TrainState", "optim_options", "rng_state", "set_rng_state",
           "FORMAT_VERSION", "META", "build_meta", "checkpoint_family", "checkpoint_model_config", "read_meta",
           "DCP_METADATA", "TRACKER", "checkpoint_dir", "checkpoint_problem", "find_checkpoint", "is_complete",
           "iterations_in", "read_dcp_metadata", "config_differences", "config_warnings", "family_problem",
           "Checkpointer", "SaveReport", "save_checkpoint", "compare_model", "load_checkpoint", "model_shapes",
           "restore_rng", "resume_vocab_size", "DEFAULT_STRICTNESS", "STRICTNESS_MODES"]
