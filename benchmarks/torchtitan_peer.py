"""torchtitan as a training-speed peer: its own llama3 model, parallelize function and optimizer,
trained on random tokens, one JSON line out.

    python benchmarks/torchtitan_peer.py --warmup 4 --iters 6            # GPU, llama-1.2b row shape
    python benchmarks/torchtitan_peer.py --tiny --device cpu --no-compile --warmup 1 --iters 1

torchtitan and its few pure-Python dependencies come from the wheels in ``.whl_titan/`` (unpacked
into a temporary folder put in front of ``sys.path``; nothing is installed, the machine's torch is
untouched). The shape is ``throughput.py``'s llama-1.2b at micro batch 2 (the ``llama-2`` row of
``peers.py``): 16 layers, hidden 2048, 32 heads, 8 KV heads, SwiGLU FFN 8192, untied embeddings,
vocabulary 128256 (megatrain's padded one), seq 4096.

What the script does, as torchtitan's ``Trainer`` does on one GPU (the trainer module itself is
not used: it imports the data/tokenizer/metrics stack, which needs packages the GPU machine may
lack): torch.distributed with world size 1 (``torchtitan.distributed.utils.init_distributed``),
``ParallelDims.from_config``, the model built on the meta device in float32
(``TrainingConfig.dtype``), ``parallelize_llama`` (per-block ``torch.compile`` and FSDP2
``fully_shard`` with bf16 parameters / fp32 reductions, activation checkpointing off),
``to_empty`` + ``init_weights``, the chunked cross-entropy loss on the lm head, the fused AdamW
of ``default_adamw``, the fwd+bwd under the SPMD context and (trainer default) CUDA-graphed,
gradient clipping at 1.0 via torchtitan's ``clip_grad_norm_``, then the optimizer step.

Output: one JSON line. On any failure: ``{"error": ...}`` and exit status 0.
"""

from __future__ import annotations

import argparse
import json
import os
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
FULL = dict(layers=16, dim=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, seq=4096, micro=2)
TINY = dict(layers=2, dim=64, heads=4, kv_heads=2, ffn=256, vocab=512, seq=128, micro=2)


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
        import typing_extensions  # noqa: F401
        from importlib.metadata import version
        major, minor = (int(x) for x in version("typing_extensions").split(".")[:2])
        old = (major, minor) < (4, 14)
    except Exception:  # noqa: BLE001
        old = True
    if old:
        sys.modules.pop("typing_extensions", None)
        sys.path.insert(0, str(target / "_fallback"))
    return [w.name for w in wheels]


def stub_triton_kernels_if_missing() -> bool:
    """torchtitan.models.common imports the MoE all-to-all kernels (Triton) at import time; a
    CPU-only machine has no triton. Those kernels are never used by a dense llama3, so stand in
    an empty module for them there. Returns whether the stub was installed."""
    try:
        import triton  # noqa: F401
        return False
    except ImportError:
        pass
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    mod = types.ModuleType(name)

    def _missing(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def _no_triton(*_a, **_k):
            raise RuntimeError(f"{attr}: triton is not installed")
        return _no_triton

    mod.__getattr__ = _missing  # type: ignore[attr-defined]
    sys.modules[name] = mod
    return True


def megatrain_flops_per_step() -> tuple[float | None, str]:
    """Model FLOPs of one step of peers.py's llama-2 row, from megatrain's own formula."""
    try:
        sys.path.insert(0, str(REPO / "benchmarks"))
        sys.path.insert(0, str(REPO))
        from peers import ROWS, expected_flops
        return float(expected_flops(ROWS["llama-2"], [])), "megatrain num_floating_point_operations (peers.expected_flops, row llama-2)"
    except Exception as e:  # noqa: BLE001
        return None, f"megatrain formula unavailable: {type(e).__name__}: {e}"


def build_model_config(s: dict, attn_backend: str):
    """torchtitan's Llama3Model.Config in the style of its own flavors (llama3/__init__.py: 8B's
    untied embeddings and inits, fused QKV, complex RoPE with llama scaling) at our shape."""
    from functools import partial

    import torch.nn as nn
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    dim, vocab = s["dim"], s["vocab"]
    return L.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=False,  # megatrain's llama-1.2b unties embeddings
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)),
        layers=L._build_llama3_layers(
            fuse_qkv=True, n_layers=s["layers"], dim=dim, n_heads=s["heads"], n_kv_heads=s["kv_heads"],
            hidden_dim=s["ffn"],
            # max_seq_len = training seq_len: what Decoder.Config.update_from_config does in the trainer
            rope=ComplexRoPE.Config(dim=dim // s["heads"], max_seq_len=s["seq"], theta=500000, scaling="llama"),
            attn_backend=attn_backend,
        ),
    )


def run(a: argparse.Namespace) -> dict:
    s = dict(TINY if a.tiny else FULL)
    for k in ("layers", "seq", "micro"):
        if getattr(a, k) is not None:
            s[k] = getattr(a, k)
    result: dict = {"peer": "torchtitan", "shape": ("tiny" if a.tiny else "llama-1.2b"), **s}
    stage = "unpack wheels"
    try:
        tmp = Path(tempfile.mkdtemp(prefix="titan-whl-"))
        result["wheels"] = unpack_wheels(Path(a.wheels), tmp)
        stage = "import"
        import torch
        result["torch"] = torch.__version__
        if a.device == "cpu":
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        result["triton_stub"] = stub_triton_kernels_if_missing()
        import spmd_types as spmd
        import torchtitan
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
        from torchtitan.components.optimizer import default_adamw
        from torchtitan.config import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.llama3 import parallelize_llama
        result["torchtitan"] = torchtitan.__version__

        stage = "init distributed"
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                     ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
            os.environ.setdefault(k, v)
        device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dump = tempfile.mkdtemp(prefix="titan-dump-")
        training = TrainingConfig(local_batch_size=s["micro"], seq_len=s["seq"], steps=a.warmup + a.iters,
                                  max_norm=1.0, disable_cuda_graphs=not a.cuda_graphs)
        parallelism = ParallelismConfig()
        compile_config = CompileConfig(enable=a.compile)
        if device.type == "cpu":
            # CPU smoke test only: torchtitan assumes "cuda" when no accelerator is found; point its
            # module-level device_type at the CPU and start gloo ourselves (init_distributed then
            # sees an initialized group and keeps it).
            import torch.distributed as dist
            import torchtitan.distributed.parallel_dims as pd_mod
            import torchtitan.tools.utils as tt_utils
            for m in (tt_utils, pd_mod, dist_utils):
                m.device_type = "cpu"
            dist.init_process_group("gloo", rank=0, world_size=1)
        world = dist_utils.init_distributed(CommConfig(), enable_cpu_backend=False, base_folder=dump)
        dims = ParallelDims.from_config(parallelism, world)
        dist_utils.set_spmd_backend(parallelism.spmd_backend)
        torch.manual_seed(0)

        stage = "build model"
        mcfg = build_model_config(s, a.attn)
        with torch.device("meta"):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(torch.float32 if training.dtype == "float32" else torch.bfloat16)
            try:
                model = mcfg.build()
            finally:
                torch.set_default_dtype(prev)
        nparams, flops_per_token = mcfg.get_nparams_and_flops(model, s["seq"])
        result["params"] = int(nparams)

        stage = "parallelize_llama"
        model = parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                  compile_config=compile_config, ac_config=None, dump_folder=dump)
        model.to_empty(device=device.type)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        result["fsdp"] = type(model).__name__

        stage = "loss and optimizer"
        loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=s["vocab"])
                                            ).build(compile_config=compile_config)
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
        optimizers = default_adamw(lr=3e-4).build(model_parts=[model])
        opt0 = optimizers.optimizers[0]
        result["optimizer"] = f"{type(opt0).__name__} fused={opt0.param_groups[0].get('fused')}"
        ctx = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)

        def fwd_bwd(inputs, labels, global_valid_tokens, extra_kwargs):
            with ctx():
                pred = model(inputs, **extra_kwargs)
                loss, _ = loss_fn(pred, labels, global_valid_tokens, positions=extra_kwargs["positions"])
                del pred
                with spmd.no_typecheck():
                    loss.backward()
            return loss

        if device.type == "cpu" and a.attn == "flex":
            # CPU smoke test only: FlexAttention has no CPU backward; stand in causal SDPA for its
            # compiled kernel (the masks are causal here: one document per row). Never on CUDA.
            import torch.nn.functional as F
            from torchtitan.models.common.attention import FlexAttention

            def _cpu_causal(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa), None
            FlexAttention._compiled_flex_attn = staticmethod(_cpu_causal)
            result["cpu_attention_shim"] = "causal SDPA in place of compiled flex_attention"

        step_fn = fwd_bwd
        if a.cuda_graphs and device.type == "cuda":
            from torchtitan.distributed.cudagraph import wrap_with_cuda_graph
            step_fn = wrap_with_cuda_graph(fwd_bwd)
        result["cuda_graphs"] = step_fn is not fwd_bwd

        g = torch.Generator(device="cpu").manual_seed(1)
        tokens = torch.randint(0, s["vocab"], (s["micro"], s["seq"] + 1), generator=g).to(device)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        positions = torch.arange(s["seq"], device=device).unsqueeze(0).expand(s["micro"], -1).contiguous()
        valid = torch.tensor(labels.numel(), dtype=torch.int64, device=device)
        params = list(model.parameters())

        def train_step():
            optimizers.zero_grad(set_to_none=training.disable_cuda_graphs)
            extra = {"positions": positions}
            if a.attn in ("flex", "flex_flash", "varlen"):  # as Trainer.post_dataloading_process
                extra["attention_masks"] = model.get_attention_masks(positions=positions)
            loss = step_fn(inputs, labels, valid, extra)
            loss = loss.detach().clone()
            dist_utils.clip_grad_norm_(params, training.max_norm, foreach=True, pp_mesh=None, ep_enabled=False)
            optimizers.step()
            return loss

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
        times_ms.sort()
        med = times_ms[len(times_ms) // 2] if len(times_ms) % 2 else sum(times_ms[len(times_ms) // 2 - 1:][:2]) / 2
        tokens_per_step = s["micro"] * s["seq"]
        result.update({
            "step_ms": round(med, 2),
            "step_ms_all": [round(t, 2) for t in times_ms],
            "tokens_per_s": round(tokens_per_step / (med / 1e3), 1),
            "losses": [round(float(x), 4) for x in losses],
        })
        if s == FULL:
            flops, src = megatrain_flops_per_step()
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
        return result
    except BaseException as e:  # noqa: BLE001 -- the table shows the reason
        tb = traceback.format_exc().strip().splitlines()
        result["error"] = f"{stage}: {type(e).__name__}: {str(e)[:600]}"
        result["traceback_tail"] = tb[-8:]
        return result
    finally:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps (compile, CUDA-graph capture)")
    ap.add_argument("--iters", type=int, default=6, help="timed steps (median reported)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape for a CPU smoke test")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layers")
    ap.add_argument("--seq", type=int, default=None, help="override the shape's sequence length")
    ap.add_argument("--micro", type=int, default=None, help="override the shape's micro batch")
    ap.add_argument("--attn", default="flex", help="torchtitan attention backend (its default: flex)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="no per-block torch.compile")
    ap.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                    help="eager fwd+bwd (the trainer's default is CUDA-graphed: training.disable_cuda_graphs=False)")
    ap.add_argument("--wheels", default=str(WHEELS))
    a = ap.parse_args()
    if a.iters < 1 or a.warmup < 0:
        emit({"peer": "torchtitan", "error": "--iters must be >= 1 and --warmup >= 0"})
        return
    emit(run(a))
    sys.stdout.flush()
    os._exit(0)  # exit 0 whatever happened (compile workers, process groups)


if __name__ == "__main__":
    main()
