"""Choosing each job's next token from its row of logits, exactly as :class:`api.Sampling` documents.

Every job has its own :class:`JobSampler`: its ``torch.Generator`` (seeded by ``Sampling.seed``, so a
job's samples do not depend on which other jobs share its decode batch), its current ``top_p`` (which
``top_p_decay`` / ``top_p_bound`` shrink after each token, as Megatron's), its logit bias and the counts
of the tokens it generated (presence and frequency penalties, OpenAI's definitions). Reported
log-probabilities are the raw model's: log-softmax of the unadjusted logits.

:func:`sample_rows` does one decode step's choice for all rows: the log-softmax, the plain greedy rows'
argmax and the top-N log-probabilities are batched; rows with a bias, a penalty or sampling run their
own few operations. One host transfer brings back the tokens and log-probabilities.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megatrain.inference.engine.api import GenerateJob, Sampling


def check_job(job: GenerateJob, vocab_size: int, max_sequence_length: int) -> None:
    """ValueError naming the field for a job that can never run."""
    if len(job.prompt_ids) == 0:
        raise ValueError("prompt_ids: a prompt needs at least one token")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in job.prompt_ids):
        raise ValueError(f"prompt_ids: every token id must be an int in 0..{vocab_size - 1}")
    if len(job.prompt_ids) >= max_sequence_length:
        raise ValueError(f"prompt_ids: a prompt of {len(job.prompt_ids)} tokens leaves no room for a new token "
                         f"within the engine's max_sequence_length ({max_sequence_length})")
    if job.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {job.max_new_tokens}")
    if job.top_logprobs < 0 or job.top_logprobs > vocab_size:
        raise ValueError(f"top_logprobs must be in 0..{vocab_size}, got {job.top_logprobs}")
    if job.eod is not None and not 0 <= job.eod < vocab_size:
        raise ValueError(f"eod must be a token id in 0..{vocab_size - 1}, got {job.eod}")
    s = job.sampling
    if s.temperature <= 0:
        raise ValueError(f"temperature must be positive, got {s.temperature}")
    if s.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {s.top_k}")
    if not 0.0 <= s.top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {s.top_p}")
    if not 0.0 <= s.top_p_decay <= 1.0 or not 0.0 <= s.top_p_bound <= 1.0:
        raise ValueError("top_p_decay and top_p_bound must be in [0, 1]")
    if (s.top_p_decay > 0 or s.top_p_bound > 0) and s.top_p == 0.0:
        raise ValueError("top_p_decay / top_p_bound need top_p > 0")
    if s.greedy and (s.top_k > 0 or 0.0 < s.top_p < 1.0):
        raise ValueError("greedy decoding cannot be combined with top_k or top_p < 1; sample instead")
    if any(not 0 <= t < vocab_size for t in s.logit_bias):
        raise ValueError(f"logit_bias: token ids must be in 0..{vocab_size - 1}")


class JobSampler:
    """One job's sampling state (see the module docstring)."""

    def __init__(self, sampling: Sampling, device: torch.device) -> None:
        self.sampling = sampling
        self.top_p = sampling.top_p
        self.counts: dict[int, int] = {}
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._bias_ids = self._bias_values = None
        if sampling.logit_bias:
            self._bias_ids = torch.tensor(list(sampling.logit_bias), dtype=torch.long, device=device)
            self._bias_values = torch.tensor(list(sampling.logit_bias.values()), dtype=torch.float32, device=device)
        self._penalised = sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits (the batched argmax is this row's choice)."""
        return self.sampling.greedy and self._bias_ids is None and not self._penalised

    def adjusted(self, logits_v: torch.Tensor) -> torch.Tensor:
        """float32 logits [V] with the logit bias added and the penalties subtracted."""
        logits = logits_v.float().clone()
        if self._bias_ids is not None:
            logits.index_add_(0, self._bias_ids, self._bias_values)
        if self._penalised and self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long, device=logits.device)
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32, device=logits.device)
            penalty = counts * self.sampling.frequency_penalty + self.sampling.presence_penalty
            logits.index_add_(0, ids, -penalty)
        return logits

    def choose(self, logits_v: torch.Tensor) -> torch.Tensor:
        """The next token (a 0-d device tensor) from the raw logits [V]."""
        s = self.sampling
        logits = self.adjusted(logits_v)
        if s.greedy:
            return logits.argmax()
        logits = logits / s.temperature
        if s.top_k > 0:
            kth_largest = torch.topk(logits, min(s.top_k, logits.shape[-1])).values[-1]
            logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        if self.top_p > 0.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # drop a token when the tokens ranked above it already reach top_p (the top one stays)
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= self.top_p
            logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
        return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=self.generator)[0]

    def observe(self, token: int) -> None:
        """After the job took ``token``: penalty counts, Megatron's top_p decay."""
        self.counts[token] = self.counts.get(token, 0) + 1
        s = self.sampling
        if self.top_p > 0.0 and s.top_p_decay > 0.0:
            self.top_p *= s.top_p_decay
            if s.top_p_bound > 0.0:
                self.top_p = max(self.top_p, s.top_p_bound)


@dataclass(frozen=True)
class Choice:
    """One row's outcome: the token, its raw log-probability, the top-N list; or ``error``."""

    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None


def sample_rows(logits_nv: torch.Tensor, samplers: list[JobSampler], top_n: list[int]) -> list[Choice]:
    """Each row's next token: ``samplers[i]`` chooses from row i of ``logits_nv`` [n, V] and reports the
    ``top_n[i]`` most likely tokens. A row whose sampling fails gets a Choice with ``error`` (the others
    are unaffected)."""
    assert logits_nv.shape[0] == len(samplers) == len(top_n)
    logits = logits_nv.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logits.argmax(dim=-1)
    errors: dict[int, str] = {}
    for i, sampler in enumerate(samplers):
        if sampler.plain_greedy:
            continue
        try:
            chosen[i] = sampler.choose(logits[i])
        except Exception as e:  # noqa: BLE001 - one job's failure (bad logits, a penalty) is that job's
            errors[i] = f"sampling failed: {type(e).__name__}: {e}"
    chosen_logprobs = logprobs.gather(1, chosen[:, None])[:, 0]
    rows = torch.stack([chosen.double(), chosen_logprobs.double()]).tolist()  # the one host transfer
    most = max(top_n, default=0)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if most > 0:
        top = torch.topk(logprobs, most, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out = []
    for i, sampler in enumerate(samplers):
        if i in errors:
            out.append(Choice(-1, float("nan"), None, errors[i]))
            continue
        token = int(rows[0][i])
        sampler.observe(token)
        top_list = None
        if top_n[i] > 0:
            top_list = list(zip(top_ids[i][:top_n[i]], top_values[i][:top_n[i]]))
        out.append(Choice(token, rows[1][i], top_list))
    return out
