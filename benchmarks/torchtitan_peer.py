"""torchtitan as a training-speed peer: its own llama3 model, parallelize function and optimizer,
trained on random tokens, one JSON line out.

    python benchmarks/torchtitan_peer.py --warmup 4 --iters 6            # GPU, llama-1.2b row shape
    python benchmarks/torchtitan_peer.py --tiny --device cpu --no-compile --warmup 1 --iters 1

Written for torchtitan 0.2.2 (0.3.0 needs a newer torch than the GPU machine's: its
``torch.distributed.fsdp.DataParallelMeshDims`` is missing from torch 2.11; the 0.3.0 version of this
script is in git history). torchtitan and its few pure-Python dependencies (tyro, docstring-parser,
typeguard, typing_extensions) come from the wheels in ``.whl_titan/``, unpacked into a temporary
folder put in front of ``sys.path``; nothing is installed, the machine's torch is untouched.

The shape is ``throughput.py``'s llama-1.2b at micro batch 2 (the ``llama-2`` row of ``peers.py``):
16 layers, hidden 2048, 32 heads, 8 KV heads, SwiGLU FFN 8192, untied embeddings, vocabulary 128256
(megatrain's padded one), seq 4096. torchtitan's ``TransformerModelArgs`` has no FFN size: its rule is
``multiple_of * ceil(int(ffn_dim_multiplier * int(8 * dim / 3)) / multiple_of)``; ffn_dim_multiplier
1.5 with multiple_of 256 (Llama 3.2 1B's values) gives exactly 8192 at dim 2048 (and 256 at the tiny
shape's dim 64). The JSON's ``params`` is torchtitan's count; ``params_megatrain`` megatrain's for the
row (``parameter_counts``): they must be equal (1,498,482,688).

What the script does is ``torchtitan.train.Trainer`` on one GPU, step by step (the trainer module
itself is not used: it needs a dataset, a tokenizer and the metrics stack): the JobConfig parsed by
torchtitan's ``ConfigManager`` (tyro) from trainer flags (``--activation_checkpoint.mode none``,
``--compile.enable``), ``init_distributed`` (world size 1), ``ParallelDims`` from the parallelism
config, ``set_determinism``, the model built on the meta device in float32 (``training.dtype``),
the (empty) model converters, ``parallelize_llama`` (per-TransformerBlock ``torch.compile`` with
fullgraph), ``to_empty`` + ``init_weights``, the cross-entropy loss of ``build_cross_entropy_loss``
(sum, divided by the valid-token count; compiled too: ``compile.components`` holds "loss"),
``build_optimizers`` (AdamW, ``implementation="fused"``), ``build_lr_schedulers``, the fwd+bwd under
``get_train_context`` and ``maybe_enable_amp``, gradient clipping at 1.0 via torchtitan's
``dist_utils.clip_grad_norm_``, the optimizer and scheduler steps, its garbage-collection handler.

One GPU means NO FSDP in torchtitan 0.2.2: ``ParallelDims.fsdp_enabled`` is ``dp_shard > 1 or cp > 1``,
and with world size 1 ``dp_shard`` resolves to 1, so ``parallelize_llama`` skips ``apply_fsdp``; the
parameters stay float32 and ``maybe_enable_amp`` wraps forward + loss in ``torch.autocast(bfloat16)``
instead. That is what this script does by default. ``--fsdp`` applies torchtitan's own ``apply_fsdp``
(FSDP2 ``fully_shard`` with bf16 parameters / fp32 reductions, the trainer's ``dp_shard > 1`` path) on a
one-rank "fsdp" mesh after ``parallelize_llama`` and runs without autocast, as the trainer does then.
Torchtitan 0.2.2 has no CUDA-graphed train step: ``--no-cuda-graphs`` is accepted, ``cuda_graphs`` is
always false. Attention: ``--attn sdpa`` (default, the llama3 flavors' own; causal), ``flex`` or
``varlen`` (the ``8B_flex`` / ``8B_varlen`` flavors' ``block_causal`` masks, built each step as the
trainer does; the random tokens never contain the stand-in EOS id, so one document per row: the
same work as causal).

Stubbed, never used on this path (the import chain of ``torchtitan.models.llama3`` reaches them):
the dataloader (torchdata), metrics (tensorboard), tokenizer (tokenizers), validator and HF
dataset modules (datasets), and the MoE Triton kernels where triton is missing.

``--profile DIR`` profiles ``--profile-steps`` more steps after the timed ones and writes ``profile_step.py``'s
kernel table and categories to ``DIR/kernels.txt`` and ``DIR/summary.json`` (``peers.py --profile --titan``
puts them beside megatrain's).

Output: one JSON line. On any failure (or a non-finite loss): ``{"error": ...}`` and exit status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import types
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".whl_titan"

# throughput.py's llama-1.2b with the llama-2 row's batch (peers.py)
FULL = {"layers": 16, "dim": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocab": 128256, "seq": 4096, "micro": 2}
TINY = {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 512, "seq": 128, "micro": 2}

# torchtitan modules that the llama3 import chain reaches but a training step never uses; they need
# packages (torchdata, tensorboard, tokenizers, datasets) the GPU machine may lack
STUBBED = (
    "torchtitan.components.dataloader",
    "torchtitan.components.metrics",
    "torchtitan.components.tokenizer",
    "torchtitan.components.validate",
    "torchtitan.hf_datasets.text_datasets",
)


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def unpack_wheels(wheel_dir: Path, target: Path) -> list[str]:
    """Unzip every wheel of ``wheel_dir`` into ``target`` (typing_extensions into ``target/_fallback``,
    used only when the machine's own one is too old for typeguard/tyro); returns the wheel names."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not any(w.name.startswith("torchtitan-") for w in wheels):
        raise FileNotFoundError(f"no torchtitan wheel in {wheel_dir}")
    for w in wheels:
        dest = target / "_fallback" if w.name.startswith("typing_extensions-") else target
        with zipfile.ZipFile(w) as z:
            z.extractall(dest)
    sys.path.insert(0, str(target))
    try:
        from importlib.metadata import version

        import typing_extensions  # noqa: F401
        major, minor = (int(x) for x in version("typing_extensions").split(".")[:2])
        old = (major, minor) < (4, 14)
    except Exception:  # noqa: BLE001
        old = True
    if old:
        sys.modules.pop("typing_extensions", None)
        sys.path.insert(0, str(target / "_fallback"))
    return [w.name for w in wheels]


class _StubModule(types.ModuleType):
    """A module whose every public name is a class that raises when instantiated or called: good
    for ``from m import X``, subclassing and annotations, never for use."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        mod = self.__name__

        def _unavailable(*_a, **_k):
            raise RuntimeError(f"{mod}.{attr} is stubbed out by torchtitan_peer.py")
        cls = type(attr, (), {"__init__": _unavailable, "__module__": mod})
        setattr(self, attr, cls)
        return cls


def install_stubs() -> list[str]:
    """Stand in ``STUBBED`` (and the MoE Triton kernels where triton is missing); returns the names."""
    names = list(STUBBED)
    try:
        import triton  # noqa: F401
    except ImportError:
        names.append("torchtitan.models.moe.kernels")
    for name in names:
        sys.modules[name] = _StubModule(name)
    return names


def ffn_args(dim: int, ffn: int) -> tuple[float, int]:
    """(ffn_dim_multiplier, multiple_of) for which torchtitan's FeedForward gives hidden size ``ffn``."""
    def rule(mult: float, multiple_of: int) -> int:  # llama3/model/model.py FeedForward.__init__
        hidden = int(mult * int(2 * (4 * dim) / 3))
        return multiple_of * ((hidden + multiple_of - 1) // multiple_of)
    for mult, multiple_of in ((1.5, 256), (1.3, 1024), (ffn / int(8 * dim / 3), ffn)):
        if rule(mult, multiple_of) == ffn:
            return mult, multiple_of
    raise ValueError(f"no ffn_dim_multiplier/multiple_of gives hidden size {ffn} at dim {dim}")


def megatrain_reference() -> tuple[float | None, int | None, str]:
    """Model FLOPs of one step of peers.py's llama-2 row (megatrain's own formula) and megatrain's
    parameter count of that model."""
    try:
        sys.path.insert(0, str(REPO / "benchmarks"))
        sys.path.insert(0, str(REPO))
        from peers import ROWS, expected_flops, megatrain_model

        from megatrain.models.gpt.memory import parameter_counts
        row = ROWS["llama-2"]
        _, cfg, _ = megatrain_model(row, [])
        return (float(expected_flops(row, [])), int(parameter_counts(cfg)[2]),
                "megatrain num_floating_point_operations (peers.expected_flops, row llama-2)")
    except Exception as e:  # noqa: BLE001
        return None, None, f"megatrain formula unavailable: {type(e).__name__}: {e}"


def profile_steps(train_step, sync, a: argparse.Namespace, device, result: dict) -> str:
    """``--profile DIR``: ``--profile-steps`` more steps under torch.profiler; the kernel table,
    categories and idle gaps of ``profile_step.py`` (as ``profile_peer.py`` writes nanoGPT's) go to
    ``DIR/kernels.txt`` and ``DIR/summary.json``. Returns the folder."""
    import torch
    sys.path.insert(0, str(REPO / "benchmarks"))
    from profile_step import kernel_report, profile_loop, write_atomic
    cuda = device.type == "cuda"
    prof, wall_ms = profile_loop(train_step, a.profile_steps, sync, cuda)
    header = (f"torchtitan {result.get('torchtitan')} llama3 L{result['layers']} dim {result['dim']} heads "
              f"{result['heads']}/{result['kv_heads']} ffn {result['ffn']} vocab {result['vocab']} | "
              f"{result['micro']} x {result['seq']} tokens/step | {result.get('mixed_precision')} | compile "
              f"{result.get('compile')} | torch {torch.__version__} | "
              f"{torch.cuda.get_device_name(device) if cuda else 'cpu: operators by self CPU time'}")
    table, summary = kernel_report(prof, cuda, a.profile_steps, wall_ms, header, a.top)
    summary.update(peer="torchtitan", **{k: result[k] for k in ("layers", "dim", "heads", "seq", "vocab", "micro")})
    out = Path(a.profile)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "kernels.txt", (table + "\n").encode())
    write_atomic(out / "summary.json", json.dumps(summary, indent=1).encode())
    return str(out)


def run(a: argparse.Namespace) -> dict:
    s = dict(TINY if a.tiny else FULL)
    for k in ("layers", "seq", "micro"):
        if getattr(a, k) is not None:
            s[k] = getattr(a, k)
    result: dict = {"peer": "torchtitan", "shape": ("tiny" if a.tiny else "llama-1.2b"), **s}
    stage = "unpack wheels"
    try:
        tmp = Path(tempfile.mkdtemp(prefix="titan-whl-"))
        a.tmp_dirs.append(tmp)
        result["wheels"] = unpack_wheels(Path(a.wheels), tmp)
        stage = "import"
        if a.device == "cpu":
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        import torch
        result["torch"] = torch.__version__
        result["stubs"] = install_stubs()
        result["triton_stub"] = "torchtitan.models.moe.kernels" in result["stubs"]
        import torchtitan
        import torchtitan.tools.utils as tt_utils
        from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss
        from torchtitan.components.lr_scheduler import build_lr_schedulers
        from torchtitan.components.optimizer import build_optimizers
        from torchtitan.config import TORCH_DTYPE_MAP, ConfigManager
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.llama3 import (
            Transformer,
            TransformerModelArgs,
            parallelize_llama,
        )
        from torchtitan.models.llama3.infra.parallelize import apply_fsdp
        from torchtitan.protocols.model_converter import build_model_converters
        result["torchtitan"] = torchtitan.__version__

        stage = "config"
        dump = tempfile.mkdtemp(prefix="titan-dump-")
        a.tmp_dirs.append(Path(dump))
        flags = ["--model.name", "llama3", "--model.hf_assets_path", dump, "--job.dump_folder", dump,
                 "--training.local_batch_size", str(s["micro"]), "--training.seq_len", str(s["seq"]),
                 # every step run (warm-up, timed, profiled) plus one: torchtitan's warmup-stable-decay
                 # schedule asserts that a decay step remains
                 "--training.steps", str(a.warmup + a.iters + (a.profile_steps if a.profile else 0) + 1),
                 "--training.max_norm", "1.0",
                 "--activation_checkpoint.mode", "none", "--debug.seed", "0", "--optimizer.implementation", "fused"]
        if a.compile:
            flags.append("--compile.enable")
        job = ConfigManager().parse_args(flags)
        mult, multiple_of = ffn_args(s["dim"], s["ffn"])
        attn_mask = "causal" if a.attn == "sdpa" else "block_causal"
        margs = TransformerModelArgs(dim=s["dim"], n_layers=s["layers"], n_heads=s["heads"], n_kv_heads=s["kv_heads"],
                                     vocab_size=s["vocab"], ffn_dim_multiplier=mult, multiple_of=multiple_of,
                                     rope_theta=500000, attn_type=a.attn, attn_mask_type=attn_mask)
        margs.update_from_config(job)  # max_seq_len = training seq_len, as the trainer does
        result.update(attn=f"{a.attn} ({attn_mask})", compile=job.compile.enable,
                      ffn_dim_multiplier=mult, multiple_of=multiple_of)

        stage = "init distributed"
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                     ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
            os.environ.setdefault(k, v)
        if a.device == "cpu":
            # CPU smoke test only: torchtitan assumes "cuda" when no accelerator is found; point its
            # module-level device_type at the CPU and start gloo ourselves (init_distributed then
            # sees an initialized group and keeps it).
            import torch.distributed as dist
            import torchtitan.distributed.parallel_dims as pd_mod
            for m in (tt_utils, pd_mod, dist_utils):
                m.device_type, m.device_module = "cpu", torch.cpu
            dist.init_process_group("gloo", rank=0, world_size=1)
            device = torch.device("cpu")
        else:
            device = torch.device(f"{tt_utils.device_type}:{int(os.environ['LOCAL_RANK'])}")
            tt_utils.device_module.set_device(device)
        world = dist_utils.init_distributed(job.comm, enable_cpu_backend=job.training.enable_cpu_offload,
                                            base_folder=job.job.dump_folder)
        p = job.parallelism
        dims = ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
                            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                            ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world)
        gc_handler = tt_utils.GarbageCollection(gc_freq=job.training.gc_freq, debug=job.training.gc_debug)
        dist_utils.set_determinism(dims, device, job.debug, distinct_seed_mesh_dims=["pp"])

        stage = "build model"
        with torch.device("meta"), tt_utils.set_default_dtype(TORCH_DTYPE_MAP[job.training.dtype]):
            model = Transformer(margs)
        converters = build_model_converters(job, dims)
        converters.convert(model)
        nparams, flops_per_token = margs.get_nparams_and_flops(model, job.training.seq_len)
        result["params"] = int(nparams)
        result["ffn_hidden"] = int(model.layers["0"].feed_forward.w1.weight.shape[0])
        loss_fn = build_cross_entropy_loss(job, parallel_dims=dims)

        stage = "parallelize_llama"
        model = parallelize_llama(model, dims, job)
        if a.fsdp and not dims.fsdp_enabled:
            # the trainer's dp_shard > 1 path, on a one-rank mesh (see the module docstring)
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))
            apply_fsdp(model, mesh, param_dtype=TORCH_DTYPE_MAP[job.training.mixed_precision_param],
                       reduce_dtype=TORCH_DTYPE_MAP[job.training.mixed_precision_reduce], pp_enabled=False,
                       cpu_offload=False, reshard_after_forward_policy=p.fsdp_reshard_after_forward)
        fsdp = a.fsdp or dims.fsdp_enabled
        model.to_empty(device=device.type)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        result["fsdp"] = type(model).__name__
        result["mixed_precision"] = (f"FSDP2 {job.training.mixed_precision_param} params, "
                                     f"{job.training.mixed_precision_reduce} reduce" if fsdp else
                                     f"torch.autocast({job.training.mixed_precision_param}), "
                                     f"{job.training.dtype} params")

        stage = "optimizer"
        optimizers = build_optimizers([model], job.optimizer, dims)
        lr_schedulers = build_lr_schedulers(optimizers, job.lr_scheduler, job.training.steps)
        optimizers.register_step_post_hook(lambda *_a, **_k: converters.post_optimizer_hook([model]))
        opt0 = optimizers.optimizers[0]
        result["optimizer"] = f"{type(opt0).__name__} fused={opt0.param_groups[0].get('fused')}"
        train_context = dist_utils.get_train_context(False)  # loss parallel needs TP
        amp = (dist_utils.maybe_enable_amp(dims, job.training.mixed_precision_param, device.type)
               if not fsdp else contextlib.nullcontext())
        result["cuda_graphs"] = False  # torchtitan 0.2.2 has no CUDA-graphed step
        if device.type == "cpu" and a.attn == "flex":
            # CPU smoke test only: FlexAttention has no CPU backward; stand in causal SDPA for its
            # compiled kernel (the masks are causal here: one document per row). Never on CUDA.
            import torch.nn.functional as F
            from torchtitan.models.attention import FlexAttentionWrapper

            def _cpu_causal(q, k, v, *, block_mask, scale, enable_gqa, return_lse):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
            FlexAttentionWrapper._compiled_flex_attn = staticmethod(_cpu_causal)
            result["cpu_attention_shim"] = "causal SDPA in place of compiled flex_attention"

        stage = "data"
        g = torch.Generator(device="cpu").manual_seed(1)
        eos = s["vocab"] - 1  # never drawn: one document per row for the block_causal masks
        tokenizer = types.SimpleNamespace(eos_id=eos)
        tokens = torch.randint(0, eos, (s["micro"], s["seq"] + 1), generator=g)
        cpu_inputs, cpu_labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        params = [p_ for p_ in model.parameters()]
        state = {"step": 0}

        def train_step():
            # Trainer.train_step with one micro batch (gradient accumulation 1), no logging
            state["step"] += 1
            gc_handler.run(state["step"])
            optimizers.zero_grad()
            valid = (cpu_labels != IGNORE_INDEX).sum().to(device).float()  # dp off: the local count
            inputs, labels = cpu_inputs.to(device), cpu_labels.to(device)
            extra = {}
            if a.attn in ("flex", "varlen"):  # Trainer.post_dataloading_process
                extra["attention_masks"] = model.get_attention_masks(input_batch=inputs, tokenizer=tokenizer,
                                                                     extra_inputs={})
            with train_context():
                with amp:
                    pred = model(inputs, **extra)
                    loss = loss_fn(pred, labels) / valid
                del pred
                loss.backward()
            dist_utils.clip_grad_norm_(params, job.training.max_norm, foreach=True,
                                       pp_mesh=dims.get_optional_mesh("pp"), ep_enabled=dims.ep_enabled)
            optimizers.step()
            lr_schedulers.step()
            return loss.detach()

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize()

        stage = "warm-up steps"
        t0 = time.time()
        losses = []
        for _ in range(a.warmup):
            losses.append(train_step())
        sync()
        result["warmup_s"] = round(time.time() - t0, 2)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

        stage = "timed steps"
        times_ms = []
        for _ in range(a.iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                losses.append(train_step())
                end.record()
                end.synchronize()
                times_ms.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                losses.append(train_step())
                times_ms.append((time.perf_counter() - t) * 1e3)
        sync()
        if a.profile:
            stage = "profiled steps"
            result["profile"] = profile_steps(train_step, sync, a, device, result)
        med = statistics.median(times_ms)
        tokens_per_step = s["micro"] * s["seq"]
        loss_values = [float(x) for x in losses]
        result.update({
            "step_ms": round(med, 2),
            "step_ms_all": [round(t, 2) for t in times_ms],
            "tokens_per_s": round(tokens_per_step / (med / 1e3), 1),
            "losses": [round(x, 4) for x in loss_values],
            "loss_finite": all(math.isfinite(x) for x in loss_values),
        })
        if s == FULL:
            flops, mt_params, src = megatrain_reference()
            result["params_megatrain"] = mt_params
            result["params_match"] = mt_params == result["params"] if mt_params else None
        else:
            flops, src = None, "megatrain formula only for the full llama-1.2b row shape"
        titan_flops = flops_per_token * tokens_per_step
        result["titan_flops_per_step"] = float(titan_flops)
        result["flops_source"] = src if flops else f"torchtitan get_nparams_and_flops ({src})"
        result["flops_per_step"] = float(flops or titan_flops)
        result["tflops"] = round(result["flops_per_step"] / (med / 1e3) / 1e12, 1)
        if device.type == "cuda":
            result["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            result["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
            result["gpu"] = torch.cuda.get_device_name(0)
        if not result["loss_finite"]:
            result["error"] = f"non-finite loss: {result['losses']}"
        return result
    except BaseException as e:  # noqa: BLE001 -- the table shows the reason
        tb = traceback.format_exc().strip().splitlines()
        result["error"] = f"{stage}: {type(e).__name__}: {str(e)[:600]}"
        result["traceback_tail"] = tb[-8:]
        return result
    finally:
        with contextlib.suppress(Exception):
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps (compile)")
    ap.add_argument("--iters", type=int, default=6, help="timed steps (median reported)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape for a CPU smoke test")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layers")
    ap.add_argument("--seq", type=int, default=None, help="override the shape's sequence length")
    ap.add_argument("--micro", type=int, default=None, help="override the shape's micro batch")
    ap.add_argument("--attn", choices=["sdpa", "flex", "varlen"], default="sdpa",
                    help="torchtitan attention (its llama3 flavors' default: sdpa)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="no per-block torch.compile")
    ap.add_argument("--fsdp", action="store_true",
                    help="torchtitan's apply_fsdp (bf16 params, fp32 reduce) on a one-rank mesh; the 0.2.2 "
                         "trainer itself skips FSDP on one GPU and uses bf16 autocast")
    ap.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_true", default=False,
                    help="accepted for compatibility; torchtitan 0.2.2 has no CUDA-graphed step")
    ap.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                    help="accepted for compatibility (the default: 0.2.2 has no CUDA graphs)")
    ap.add_argument("--wheels", default=str(WHEELS))
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after the timed steps, profile more steps: kernels.txt and summary.json into DIR "
                         "(profile_step.py's tables, as profile_peer.py writes nanoGPT's)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=40, help="kernel table rows with --profile")
    a = ap.parse_args()
    if a.iters < 1 or a.warmup < 0:
        emit({"peer": "torchtitan", "error": "--iters must be >= 1 and --warmup >= 0"})
        return
    a.tmp_dirs = []
    emit(run(a))
    sys.stdout.flush()
    for d in a.tmp_dirs:
        shutil.rmtree(d, ignore_errors=True)
    os._exit(0)  # exit 0 whatever happened (compile workers, process groups)


if __name__ == "__main__":
    main()
