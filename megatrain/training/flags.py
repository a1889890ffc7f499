"""Flags of the training package's concerns, with Megatron-LM's names, defaults and attribute names.

One function per concern: the loop (batch sizes, length, exits, device, seed), between-step
housekeeping (:mod:`megatrain.training.housekeeping`), the optimizer (:mod:`megatrain.optimizer`),
the learning-rate schedule (:mod:`megatrain.training.lr_schedule`), precision and loss scaling
(:mod:`megatrain.training.builders`, :mod:`megatrain.training.loss_scaler`), logging
(:mod:`megatrain.training.logging`) and evaluation.
"""

from __future__ import annotations

import argparse

from megatrain.flags import flag_section

__all__ = ["add_loop_flags", "add_housekeeping_flags", "add_optimizer_flags", "add_lr_flags",
           "add_precision_flags", "add_logging_flags", "add_validation_flags"]


def add_loop_flags(parser: argparse.ArgumentParser) -> None:
    """Batch sizes, the run's length, exits, the device and the seed."""
    g = flag_section(parser, "training")
    g.add_argument("--micro-batch-size", type=int, default=None, help="batch size per GPU per forward pass")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step (default micro-batch * data-parallel size)")
    g.add_argument("--batch-size", type=int, default=None, help="old name of --micro-batch-size")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="grow the global batch from START by INCREMENT over the first SAMPLES samples "
                        "(needs --train-samples)")
    g.add_argument("--step-batch-size-schedule", nargs="+", default=None, metavar="THRESHOLD:BATCH",
                   help='step-wise global batch size, e.g. "0:16 2.4B:320 12B:1536": from THRESHOLD tokens on '
                        "(K/M/B/T suffixes; divided by --seq-length into samples) the global batch is BATCH; "
                        "the last BATCH is --global-batch-size (Megatron-LM's schedule; one quoted word or several)")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None, help="exit when iteration %% N == 0")
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true", help="on SIGTERM save and exit cleanly")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="average the loss over all loss tokens of the global batch (default: over each "
                        "micro-batch's tokens, then over micro-batches)")
    g.add_argument("--max-nan-iterations", type=int, default=10,
                   help="stop the run after this many iterations with a NaN/inf loss or gradient")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad",
                   help="keep training through iterations with a NaN/inf loss or gradient (their optimizer step "
                        "is still skipped) instead of stopping after --max-nan-iterations")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g = flag_section(parser, "initialization")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data-parallel-random-init", action="store_true",
                   help="initialise each data-parallel replica with a different seed (Megatron's option)")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="draw the initial weights on the CPU when training on a GPU (by default they are drawn on "
                        "the GPU: a faster start; the values differ, and both are the same under every parallel "
                        "layout)")


def add_housekeeping_flags(parser: argparse.ArgumentParser) -> None:
    """Between steps: garbage collection, releasing cached CUDA memory, the profiler window."""
    g = flag_section(parser, "training")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn off Python's automatic garbage collection during training; collect every "
                        "--manual-gc-interval iterations and around evaluation instead")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="with --manual-gc: collect every N iterations "
                                                                       "(0: only at start and around evaluation)")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="with --manual-gc: do not collect around evaluation")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="release cached CUDA memory: 1 after each step's forward/backward and each evaluation, "
                        "2 also after the optimizer step")
    g.add_argument("--profile", action="store_true",
                   help="record a torch.profiler trace of iterations --profile-step-start to --profile-step-end")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="global ranks to profile")
    g.add_argument("--use-pytorch-profiler", action="store_true", help="the profiler used by --profile (always)")
    g.add_argument("--profile-dir", default=None,
                   help="where --profile writes its trace (default --tensorboard-dir, else ./profile)")
    g.add_argument("--record-memory-history", action="store_true",
                   help="CUDA: record the caching allocator's history from start-up on the --profile-ranks and "
                        "write a memory snapshot (torch.cuda.memory._snapshot, for pytorch.org/memory_viz) to "
                        "--memory-snapshot-path at every log line")
    g.add_argument("--memory-snapshot-path", default="snapshot.pickle",
                   help="where --record-memory-history writes its snapshot; the rank goes before the extension "
                        "(snapshot_0.pickle)")


def add_optimizer_flags(parser: argparse.ArgumentParser) -> None:
    """Weight decay, gradient clipping, the optimizer and its hyper-parameters."""
    g = flag_section(parser, "regularization")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"])
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient clipping on the global L2 norm (0: off)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g = flag_section(parser, "training")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])


def add_lr_flags(parser: argparse.ArgumentParser) -> None:
    """The learning-rate schedule, and which schedule wins on ``--load``."""
    g = flag_section(parser, "learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak LR of the input embedding and output layer (their own schedule)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="minimum LR of the input embedding and output layer (default --min-lr)")
    # Megatron-LM's two spellings of each, and the names before its scheduler was renamed.
    g.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler", "--override-lr-scheduler",
                   action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on --load, train with the flags' LR and weight-decay schedule where it differs from the "
                        "checkpoint's (the step count is still the checkpoint's); without this flag or "
                        "--use-checkpoint-opt_param-scheduler a difference is refused")
    g.add_argument("--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler",
                   "--use-checkpoint-lr-scheduler", action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on --load, train with the checkpoint's LR and weight-decay schedule where it differs "
                        "from the flags'")


def add_precision_flags(parser: argparse.ArgumentParser) -> None:
    """The compute dtype and fp16 loss scaling."""
    g = flag_section(parser, "mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (default dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")


def _logging_level(text: str) -> int:
    """--logging-level: a number, as Megatron-LM takes it, or a level name (DEBUG, INFO, ...)."""
    import logging

    if text.strip().lstrip("-").isdigit():
        return int(text)
    level = logging.getLevelName(text.strip().upper())
    if not isinstance(level, int):
        raise argparse.ArgumentTypeError(f"expected a number or DEBUG, INFO, WARNING, ERROR, CRITICAL, got {text!r}")
    return level


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """TensorBoard and Weights & Biases."""
    g = flag_section(parser, "logging")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-throughput", action="store_true", help="always on here")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-params-norm", action="store_true",
                   help="log the L2 norm of the trained weights after each step (params norm: in the log line)")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="log how many gradient elements are zero (num zeros: in the log line)")
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument("--logging-level", type=_logging_level, default=None,
                   help="level of Python's root logger, a number (10 DEBUG, 20 INFO, 30 WARNING, 40 ERROR) or "
                        "a name; else the MEGATRON_LOGGING_LEVEL environment variable, as in Megatron-LM")


def add_validation_flags(parser: argparse.ArgumentParser) -> None:
    """Evaluation on the validation split."""
    g = flag_section(parser, "validation")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--skip-train", action="store_true")
