"""The chunked output-layer loss under parallel layouts: DDP and ZeRO-3 use it, tensor parallel its
chunked vocab-parallel loss; all train exactly like one plain process with the plain loss (the
real trainer in both, see dist_harness)."""

from __future__ import annotations

from dist_harness import compare, run_layouts

TOLERANCE = 1e-5
CHUNK = "--cross-entropy-chunk-size 12"
CASES = {"ddp_tied": ("gpt2", CHUNK, dict(steps=4)),
         "zero3_untied": ("llama", f"{CHUNK} --zero-stage 3", dict(steps=4)),
         "tp2": ("gpt2", f"{CHUNK} --tensor-model-parallel-size 2", dict(steps=4)),
         "tp2_untied": ("llama", f"{CHUNK} --tensor-model-parallel-size 2", dict(steps=4))}


def test_chunked_loss_in_data_parallel_and_tensor_parallel_layouts():
    references, results = run_layouts(CASES, 2)
    for per_rank in results:
        for name, run in per_rank.items():
            assert run.info["chunks"], name
            assert not references[name].info["chunks"], name
            r = compare(run, references[name])
            assert r["loss"] < TOLERANCE and r["params"] < TOLERANCE, (name, r)
