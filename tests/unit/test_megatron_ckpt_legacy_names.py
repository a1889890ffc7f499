"""Megatron-LM's pre-core ("legacy", ``--use-legacy-models``) GPT checkpoints: ``language_model.embedding.*``,
``language_model.encoder|transformer.layers.N.*`` (``self_attention|attention.query_key_value``, ``dense``,
``post_attention_layernorm``, ``mlp.dense_h_to_4h``/``dense_4h_to_h``), nested or flat, read as megatron-core's
names: megatrain -> ``--saver megatron`` (TP 2 x PP 2) -> rewritten into the legacy names and parameter order
(Adam's indices renumbered with it) -> megatrain gives the weights and moments back bit-exact (a tied GPT-2 shape
and a LLaMA one: GQA, SwiGLU, RMSNorm, rope); checkpoint_version 0 and 1.0 files' query_key_value order
(``fix_query_key_value_ordering``); what has no counterpart is refused in one line."""

from __future__ import annotations

import os

import pytest
import torch

from megatrain import checkpoint as C
from megatrain.convert.megatron.bridge import export_megatron, import_megatron
from megatrain.convert.megatron.names import UnsupportedMegatronModel
from megatrain.convert.megatron.reader import read_megatron_checkpoint
from megatrain.models.gpt.config import GPTConfig
from tests.unit.test_megatron_legacy_optim import GPT2, LLAMA, _same, _save

_LAYER = {"input_layernorm": ("input_layernorm", 0),
          "self_attention.linear_qkv": ("self_attention.query_key_value", 1),
          "self_attention.linear_proj": ("self_attention.dense", 2), "pre_mlp_layernorm": ("post_attention_layernorm", 3),
          "mlp.linear_fc1": ("mlp.dense_h_to_4h", 4), "mlp.linear_fc2": ("mlp.dense_4h_to_h", 5)}


def _legacy(key: str, old: bool) -> tuple[str, tuple]:
    """A megatron-core name's legacy one, and its place in the legacy model's parameter order."""
    block = "language_model.transformer" if old else "language_model.encoder"
    if key.startswith("embedding."):
        return "language_model." + key, (0, key.endswith("position_embeddings.weight"))
    if key.startswith("decoder.final_layernorm."):
        return f"{block}.{'final_layernorm' if old else 'final_norm'}.{key.rsplit('.', 1)[1]}", (2, key)
    if key == "output_layer.weight":
        return "language_model.output_layer.weight", (3,)
    _, _, n, rest = key.split(".", 3)
    module, p = rest.rsplit(".", 1)
    name, place = _LAYER[module]
    if old:
        name = name.replace("self_attention.", "attention.")
    return f"{block}.layers.{n}.{name}.{p}", (1, int(n), place, p != "weight")


def _nest(flat: dict[str, torch.Tensor]) -> dict:
    """The nested vintage: language_model -> embedding -> word_embeddings -> weight, the encoder's keys flat inside."""
    out: dict = {}
    for k, v in flat.items():
        parts = k.split(".")
        if k.startswith(("language_model.encoder.", "language_model.transformer.")):
            parts = parts[:2] + [".".join(parts[2:])]
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v
    return out


def _to_legacy(out: str, *, nested: bool, old: bool, tied: bool, version=None, qkv=None) -> None:
    """Every rank file's model dict (megatron-core names, local spec) in the legacy names and parameter order, its
    Adam indices renumbered to that order; ``qkv`` reorders each rank's query_key_value rows (and their moments)."""
    it = os.path.join(out, "iter_0000003")
    for rank in sorted(os.listdir(it)):
        path = os.path.join(it, rank, "model_optim_rng.pt")
        sd = torch.load(path, weights_only=False)
        model = {k: v for k, v in sd["model"].items() if not k.endswith("_extra_state")}
        order = list(model)
        opt = sd.get("optimizer")
        by_key = {}
        if opt is not None:
            members = [k for g in opt["param_groups"] for k in
                       [k for k in order if (model[k].dim() == 1 or k.endswith(".bias")) == (g["wd_mult"] == 0.0)]]
            index = [i for g in opt["param_groups"] for i in g["params"]]
            by_key = {k: opt["state"][i] for k, i in zip(members, index)}
        first = any(k.startswith("embedding.") for k in model)
        renamed = {}
        for k in order:
            name, place = _legacy(k, old)
            if k == "output_layer.weight" and tied and not first:
                name, place = "word_embeddings_for_head.weight", (9,)
            renamed[k] = (name, place)
        new_order = sorted(order, key=lambda k: renamed[k][1])
        flat = {}
        for k in new_order:
            t = model[k]
            if qkv is not None and "linear_qkv" in k:
                t = qkv(t)
                for m in ("exp_avg", "exp_avg_sq"):
                    if k in by_key:
                        by_key[k][m] = qkv(by_key[k][m])
            flat[renamed[k][0]] = t
        if opt is not None:
            state, n = {}, 0
            for g in opt["param_groups"]:
                keys = [k for k in new_order if (model[k].dim() == 1 or k.endswith(".bias")) == (g["wd_mult"] == 0.0)]
                g["params"] = list(range(n, n + len(keys)))
                state.update({n + i: by_key[k] for i, k in enumerate(keys)})
                n += len(keys)
            opt["state"] = state
        sd["model"] = _nest(flat) if nested else flat
        if version is None:
            sd.pop("checkpoint_version", None)
        else:
            sd["checkpoint_version"] = version
        torch.save(sd, path)


@pytest.mark.parametrize("shape", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("nested,old", [(False, False), (True, False), (True, True)], ids=["flat", "nested", "old"])
def test_legacy_names_read_bit_exact(tmp_path, shape, nested, old):
    cfg = GPTConfig(**shape)
    ours = _save(tmp_path, cfg)
    out = str(tmp_path / "legacy")
    export_megatron(ours, out, saver="megatron", tp=2, pp=2, transformer_impl="local", progress=False)
    _to_legacy(out, nested=nested, old=old, tied=not cfg.untie_embeddings_and_output_weights, version=3.0)
    sd = torch.load(os.path.join(out, "iter_0000003", "mp_rank_00_000", "model_optim_rng.pt"), weights_only=False)
    assert ("language_model" in sd["model"]) if nested else any(k.startswith("language_model.") for k in sd["model"])
    report = import_megatron(out, str(tmp_path / "back"), progress=False, quiet=True)
    assert report.config == cfg
    assert report.note is None and C.read_meta(report.path)["has_optimizer"]
    _same(C.find_checkpoint(ours), report.path, cfg)


def _v0(t: torch.Tensor) -> torch.Tensor:  # [np, 3, hn] -> checkpoint_version 0's [3, np, hn] (2 heads a rank)
    return t.reshape(2, 3, 4, *t.shape[1:]).transpose(0, 1).contiguous().reshape(t.shape)


def _v1(t: torch.Tensor) -> torch.Tensor:  # [np, 3, hn] -> checkpoint_version 1.0's [np, hn, 3]
    return t.reshape(2, 3, 4, *t.shape[1:]).transpose(1, 2).contiguous().reshape(t.shape)


@pytest.mark.parametrize("version,qkv", [(0, _v0), (1.0, _v1), (None, _v0)], ids=["v0", "v1.0", "absent-is-0"])
def test_old_checkpoint_versions_reorder_query_key_value(tmp_path, version, qkv):
    cfg = GPTConfig(**GPT2)  # multi-head attention, biases: 4 heads of 4, 2 a TP rank
    ours = _save(tmp_path, cfg)
    out = str(tmp_path / "legacy")
    export_megatron(ours, out, saver="megatron", tp=2, pp=2, transformer_impl="local", progress=False)
    _to_legacy(out, nested=True, old=True, tied=True, version=version, qkv=qkv)
    report = import_megatron(out, str(tmp_path / "back"), progress=False, quiet=True)
    assert report.note is None
    _same(C.find_checkpoint(ours), report.path, cfg)


def test_legacy_parts_without_counterpart_are_refused(tmp_path):
    cfg = GPTConfig(**GPT2)
    ours = _save(tmp_path, cfg)
    out = str(tmp_path / "legacy")
    export_megatron(ours, out, saver="megatron", tp=1, pp=1, transformer_impl="local", progress=False)
    _to_legacy(out, nested=False, old=False, tied=True, version=3.0)
    path = os.path.join(out, "iter_0000003", "mp_rank_00", "model_optim_rng.pt")
    sd = torch.load(path, weights_only=False)
    sd["model"]["language_model.embedding.tokentype_embeddings.weight"] = torch.zeros(2, 16)
    torch.save(sd, path)
    with pytest.raises(UnsupportedMegatronModel, match="tokentype_embeddings.*no megatron-core counterpart"):
        read_megatron_checkpoint(out, progress=False)
    del sd["model"]["language_model.embedding.tokentype_embeddings.weight"]
    sd["checkpoint_version"] = 1.5
    torch.save(sd, path)
    with pytest.raises(UnsupportedMegatronModel, match="checkpoint_version 1.5"):
        read_megatron_checkpoint(out, progress=False)


def test_older_rotary_flag_reads_as_rope():
    from megatrain.convert.megatron.args import config_from_megatron_args
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, max_position_embeddings=32,
                padded_vocab_size=64)
    cfg = config_from_megatron_args({**base, "use_rotary_position_embeddings": True}, "x")
    assert cfg.position_embedding_type == "rope"
    assert config_from_megatron_args(base, "x").position_embedding_type == "learned_absolute"
