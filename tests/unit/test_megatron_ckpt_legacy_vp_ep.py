"""Legacy (``torch`` format) Megatron-LM checkpoints of the interleaved pipeline schedule (``model0``,
``model1``, ... per rank file) and of expert parallelism (``mp_rank_TT[_PPP]_EEE``): files laid out as
Megatron-LM saves them, from a known megatrain model, read back bit-exactly."""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch

from megatrain.convert.megatron.bridge import export_megatron
from megatrain.convert.megatron.names import UnsupportedMegatronModel
from megatrain.convert.megatron.pickles import load_megatron_pt
from megatrain.convert.megatron.reader import read_megatron_checkpoint

from tests.unit.test_megatron_ckpt import GPT2, LLAMA, MOE, _ours, import_equals_ours

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _relayout(src: str, dst: str, tp: int, pp: int, vp: int, ep: int, num_layers: int, experts: int = 0) -> str:
    """The TP x PP=1 legacy checkpoint ``src`` (written by `export_megatron`) re-saved as Megatron-LM lays out
    TP x PP x VP x EP: chunk c of stage r holds global layers c * L/vp + r * L/(pp*vp) onward (megatron-core's
    get_transformer_layer_offset), renumbered from 0; the embedding in stage 0's chunk 0, the final norm and
    output layer in the last stage's last chunk; expert rank e holds experts e * E/ep + l as local l."""
    per_chunk, per_ep = num_layers // (pp * vp), (experts // ep if experts else 0)
    it = os.path.join(dst, "iter_0000007")
    for t in range(tp):
        sd = load_megatron_pt(os.path.join(src, "iter_0000007", f"mp_rank_{t:02d}", "model_optim_rng.pt"))
        model = sd.pop("model")
        args = copy.copy(sd["args"])
        args.pipeline_model_parallel_size, args.expert_model_parallel_size = pp, ep
        args.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
        for r in range(pp):
            for e in range(ep):
                chunks = []
                for c in range(vp):
                    first = c * (num_layers // vp) + r * per_chunk
                    out = {}
                    for name, v in model.items():
                        m = _LAYER.match(name)
                        if m:
                            layer = int(m.group(1))
                            if not first <= layer < first + per_chunk:
                                continue
                            local = f"decoder.layers.{layer - first}.{m.group(2)}"
                            x = _EXPERT.match(local)
                            if x:
                                g = int(x.group(2))
                                if g // per_ep != e:
                                    continue
                                local = f"{x.group(1)}{g - e * per_ep}{x.group(3)}"
                            out[local] = v
                        elif name.startswith("embedding."):
                            if r == 0 and c == 0:
                                out[name] = v
                        elif r == pp - 1 and c == vp - 1:
                            out[name] = v
                    if r == pp - 1 and c == vp - 1 and "output_layer.weight" not in out and pp * vp > 1:
                        out["output_layer.weight"] = model["embedding.word_embeddings.weight"]  # tied copy
                    chunks.append(out)
                name = f"mp_rank_{t:02d}" + (f"_{r:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                os.makedirs(os.path.join(it, name))
                state = {**sd, "args": args}
                if vp > 1:
                    state.update({f"model{c}": chunk for c, chunk in enumerate(chunks)})
                else:
                    state["model"] = chunks[0]
                torch.save(state, os.path.join(it, name, "model_optim_rng.pt"))
    with open(os.path.join(dst, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("7")
    return dst


def _check(tmp_path, shape, tp, pp, vp, ep):
    ours, cfg = _ours(tmp_path, shape)
    flat = str(tmp_path / "flat")
    export_megatron(ours, flat, saver="megatron", tp=tp, pp=1, progress=False)
    out = _relayout(flat, str(tmp_path / "megatron"), tp, pp, vp, ep, cfg.num_layers, cfg.num_moe_experts or 0)
    ck = read_megatron_checkpoint(out, progress=False)
    assert not [x for x in ck.left_out if "optimizer" in x]  # saved without one: nothing to note
    import_equals_ours(out, str(tmp_path / "back"), ours, cfg)
    return out, ck


@pytest.mark.parametrize("shape", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("tp,pp,vp", [(1, 2, 2), (2, 2, 2), (1, 1, 2), (1, 2, 4)])
def test_virtual_pipeline_reads_bit_exact(tmp_path, shape, tp, pp, vp):
    out, ck = _check(tmp_path, dict(shape, num_layers=8), tp, pp, vp, 1)
    if (tp, pp, vp) == (1, 2, 2):  # stage 1's chunk 0 holds global layers 2, 3 (chunk 1 of stage 0: 4, 5)
        sd = load_megatron_pt(os.path.join(out, "iter_0000007", "mp_rank_00_001", "model_optim_rng.pt"))
        assert "model" not in sd and set(sd) >= {"model0", "model1"}
        w = sd["model0"]["decoder.layers.1.self_attention.linear_proj.weight"]
        assert torch.equal(w, ck.tensors["decoder.layers.3.self_attention.linear_proj.weight"])
        w = sd["model1"]["decoder.layers.0.self_attention.linear_proj.weight"]
        assert torch.equal(w, ck.tensors["decoder.layers.6.self_attention.linear_proj.weight"])


@pytest.mark.parametrize("tp,pp,vp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2)])
def test_expert_parallel_reads_bit_exact(tmp_path, tp, pp, vp):
    shape = dict(MOE, num_layers=8) if vp > 1 else MOE
    out, ck = _check(tmp_path, shape, tp, pp, vp, 2)
    names = sorted(os.listdir(os.path.join(out, "iter_0000007")))
    assert names[-1] == f"mp_rank_{tp - 1:02d}" + (f"_{pp - 1:03d}" if pp > 1 else "") + "_001"
    sd = load_megatron_pt(os.path.join(out, "iter_0000007", names[-1], "model_optim_rng.pt"))
    model = sd["model0" if vp > 1 else "model"]
    assert {int(m.group(2)) for m in map(_EXPERT.match, model) if m} == {0, 1}  # local ids; global 2, 3


def test_virtual_pipeline_optimizer_is_noted(tmp_path):
    ours, cfg = _ours(tmp_path, dict(LLAMA, num_layers=8))
    flat = str(tmp_path / "flat")
    export_megatron(ours, flat, saver="megatron", tp=1, pp=1, progress=False)
    out = _relayout(flat, str(tmp_path / "megatron"), 1, 2, 2, 1, 8)
    for n in os.listdir(os.path.join(out, "iter_0000007")):
        path = os.path.join(out, "iter_0000007", n, "model_optim_rng.pt")
        sd = load_megatron_pt(path)
        sd["optimizer"] = {"optimizer": {"state": {}, "param_groups": []}}
        torch.save(sd, path)
    ck = read_megatron_checkpoint(out, progress=False)
    assert ck.optimizer is None
    assert any("virtual-pipeline" in x and "starts fresh" in x for x in ck.left_out)


def test_expert_tensor_parallel_other_than_tp_is_refused(tmp_path):
    ours, cfg = _ours(tmp_path, MOE)
    flat = str(tmp_path / "flat")
    export_megatron(ours, flat, saver="megatron", tp=2, pp=1, progress=False)
    out = _relayout(flat, str(tmp_path / "megatron"), 2, 1, 1, 2, cfg.num_layers, cfg.num_moe_experts)
    for n in os.listdir(os.path.join(out, "iter_0000007")):
        path = os.path.join(out, "iter_0000007", n, "model_optim_rng.pt")
        sd = load_megatron_pt(path)
        sd["args"].expert_tensor_parallel_size = 1
        torch.save(sd, path)
    with pytest.raises(UnsupportedMegatronModel, match="expert-tensor-parallel-size 1"):
        read_megatron_checkpoint(out, progress=False)
