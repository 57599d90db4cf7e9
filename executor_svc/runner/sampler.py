"""Vectorised sampler: penalties -> logit bias -> min-tokens mask -> temperature -> top-k -> top-p
-> min-p -> sample.

Every stage works on whole-batch tensors; Python touches each row only to build small per-row
tensors (parameters, hash keys, penalty token lists).

Randomness is an exponential race: token = argmax_i p_i / E_i with E_i ~ Exp(1), which picks i
with probability p_i. E_i comes from a counter-based hash of (seed, output position, token id),
never from a stateful generator, so a seeded row draws the same token whatever else is in the
batch and however its sequence was chunked, preempted or resumed. Dropped tokens are -inf before
the race, so the race itself needs no renormalisation.

Top-k/top-p rows work on a sorted candidate slice (torch.topk) instead of sorting the vocabulary
(a full sort of 64 x 49152 costs tens of argmaxes on CPU); top-p-only rows size the slice from a probability
histogram. Candidates are ordered by (logit desc, token id asc), a total order, so the kept set
is the same in any batch; a row whose kept set might reach past the slice (a tie with the slice
edge) is redone over the fully sorted vocabulary.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from executor_svc.kernels import sampling
from executor_svc.runner.inputs import upload
from executor_svc.runner.noise import race, row_key

if TYPE_CHECKING:
    from protos import executor_pb2

# Temperatures below this are greedy: dividing by them overflows float32 logits.
_SAMPLING_EPS = 1e-5
# Float32 cumsum slack: a nucleus whose mass reaches top_p to within rounding has reached it,
# so a boundary exactly at top_p does not pull in one more token.
_TOP_P_EPS = 1e-6
# Histogram that bounds a top-p nucleus (see _nucleus_bound): 32 nats below the max.
_BINS_PER_NAT = 8
_NUM_BINS = 256

# Unseeded rows draw a fresh seed per call; random.Random() seeds itself from os.urandom.
_seed_source = random.Random()


@dataclass(slots=True)
class SamplingParams:  # mirrors executor.proto SamplingParams
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # <= 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    num_logprobs: int = 0
    min_tokens: int = 0  # 0 disables the mask below
    # Masked (-inf) while the output is shorter than min_tokens: the model's EOS ids plus the
    # proto's min_tokens_suppressed_ids. Empty when min_tokens is 0.
    min_tokens_masked_ids: tuple[int, ...] = ()
    # OpenAI's logit_bias as parallel tuples (ids, values); empty when the request has none.
    logit_bias_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()
    # Top alternatives per prompt logprob; None = no prompt logprobs (read by the model runner).
    num_prompt_logprobs: int | None = None
    # Never sampled: the sequence's request only scores its prompt (read by the model runner).
    prompt_only: bool = False

    @classmethod
    def from_proto(
        cls, pb: executor_pb2.SamplingParams, eos_token_ids: Sequence[int] = ()
    ) -> SamplingParams:
        # proto3 zeros mean "unset": top_p and repetition_penalty of 0 would otherwise drop
        # every token / divide by zero, so they read as "disabled" (1).
        min_tokens = int(pb.min_tokens)
        masked = (
            tuple(sorted({*eos_token_ids, *pb.min_tokens_suppressed_ids})) if min_tokens else ()
        )
        return cls(
            temperature=float(pb.temperature),
            top_k=int(pb.top_k) if pb.top_k > 0 else 0,
            top_p=float(pb.top_p) if pb.top_p > 0 else 1.0,
            min_p=float(pb.min_p),
            presence_penalty=float(pb.presence_penalty),
            frequency_penalty=float(pb.frequency_penalty),
            repetition_penalty=float(pb.repetition_penalty) if pb.repetition_penalty > 0 else 1.0,
            seed=int(pb.seed) if pb.HasField("seed") else None,
            num_logprobs=int(pb.num_logprobs),
            min_tokens=min_tokens if masked else 0,
            min_tokens_masked_ids=masked,
            logit_bias_ids=tuple(pb.logit_bias.keys()),
            logit_bias_values=tuple(pb.logit_bias.values()),
            num_prompt_logprobs=(
                int(pb.num_prompt_logprobs) if pb.HasField("num_prompt_logprobs") else None
            ),
            prompt_only=bool(pb.prompt_only),
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_seqs] int64
    logprobs: torch.Tensor  # [num_seqs] float32, of the sampled token, raw distribution
    top_token_ids: torch.Tensor | None  # [num_seqs, max_num_logprobs]
    top_logprobs: torch.Tensor | None  # [num_seqs, max_num_logprobs]


# ---------------------------------------------------------------------------------------------
# Penalties


def _flat_keys(
    rows: list[int], lists: list[list[list[int]]], vocab: int, device: torch.device
) -> torch.Tensor:
    # row * vocab + token for every token of the given rows, built with one tensor conversion.
    per_row = [list(itertools.chain.from_iterable(src[i] for src in lists)) for i in rows]
    lengths = torch.tensor([len(t) for t in per_row], dtype=torch.int64)
    tokens = torch.tensor(list(itertools.chain.from_iterable(per_row)), dtype=torch.int64)
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    return (row_ids * vocab + tokens).to(device)


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """Penalised copy of logits [n, V]: repetition (prompt + output), then frequency/presence.

    Sparse: only the (row, token) entries that occur are gathered, changed and written back.
    """
    n, vocab = logits.shape
    out = logits.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    device = logits.device
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        keys = torch.unique(
            _flat_keys(rep_rows, [prompt_token_ids, output_token_ids], vocab, device)
        )
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[keys // vocab]
        x = flat[keys]
        flat[keys] = torch.where(x > 0, x / rep, x * rep)
    fp_rows = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if fp_rows:
        keys, counts = torch.unique(
            _flat_keys(fp_rows, [output_token_ids], vocab, device), return_counts=True
        )
        rows = keys // vocab
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[rows]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[rows]
        flat[keys] -= freq * counts + pres
    return out


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Adds each row's logit_bias to its logits, in place; returns logits. Sparse, like the
    penalties: one scatter-add over the (row, id) pairs that carry a bias."""
    vocab = logits.shape[1]
    keys = [i * vocab + t for i, p in enumerate(params) for t in p.logit_bias_ids]
    values = [b for p in params for b in p.logit_bias_values]
    flat = logits.view(-1)
    flat.index_add_(
        0,
        torch.tensor(keys, dtype=torch.int64).to(logits.device),
        torch.tensor(values, dtype=logits.dtype).to(logits.device),
    )
    return logits


def apply_min_tokens(
    logits: torch.Tensor, params: list[SamplingParams], rows: list[int]
) -> torch.Tensor:
    """-inf at each given row's min_tokens_masked_ids, in place; returns logits.

    Like the penalties it is sparse: one scatter over (row, id) pairs, nothing per vocabulary.
    """
    vocab = logits.shape[1]
    keys = [i * vocab + t for i in rows for t in params[i].min_tokens_masked_ids]
    logits.view(-1)[torch.tensor(keys, dtype=torch.int64).to(logits.device)] = float("-inf")
    return logits


# ---------------------------------------------------------------------------------------------
# Truncation (top-k, top-p, min-p)


def _nucleus_bound(scaled: torch.Tensor, lse: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[n] int64 upper bound on each row's nucleus size, without sorting the vocabulary.

    Mass histogram over bins of 1/8 nat below the row's max: the nucleus ends inside the first
    bin whose cumulative mass reaches top_p, so every token up to that bin (plus one bin of
    rounding slack) is enough. The last bin collects everything deeper; a nucleus reaching it
    needs the whole vocabulary. Five passes and no sort.
    """
    vmax = scaled.max(dim=-1, keepdim=True).values  # [n, 1]
    bins = (vmax - scaled).mul_(_BINS_PER_NAT).clamp_(max=_NUM_BINS - 1).long()  # floor (>= 0)
    probs = (scaled - lse[:, None]).exp_()
    mass = scaled.new_zeros(scaled.shape[0], _NUM_BINS).scatter_add_(1, bins, probs)
    # The slack makes this a bound even when the candidate cumsum rounds differently.
    target = (top_p + 10 * _TOP_P_EPS)[:, None]
    last_bin = (mass.cumsum(dim=-1) < target).sum(dim=-1, keepdim=True)  # [n, 1]
    edge = torch.where(
        last_bin >= _NUM_BINS - 1, float("-inf"), vmax - (last_bin + 2) / _BINS_PER_NAT
    )
    return (scaled >= edge).sum(dim=-1)


def _candidates(
    logits: torch.Tensor,  # [n, V] penalised
    temperature: torch.Tensor | None,  # [n] > 0; None when logits are scaled already
    top_k: torch.Tensor,  # [n] int64 in [1, V]; V = disabled
    top_p: torch.Tensor,  # [n]; >= 1 = disabled
    min_p: torch.Tensor,  # [n]; 0 = disabled
    lse_full: torch.Tensor | None,  # [n] logsumexp of scaled logits; None when top-k is on
    num_candidates: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted candidate slice -> (scores, token ids, exact), [n, K], dropped scores -inf.

    exact[i] is False when row i's kept set could reach past the slice; it must be redone with
    num_candidates = V. Dividing by T > 0 keeps the order, so top-k rows sort unscaled logits
    and scale only their candidates.
    """
    n, vocab = logits.shape
    if num_candidates >= vocab:
        vals, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    else:
        vals, ids = torch.topk(logits, num_candidates, dim=-1)
        # topk orders ties arbitrarily; re-sort to (value desc, id asc).
        ids, perm = ids.sort(dim=-1)
        vals, perm2 = vals.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(-1, perm2)
    num_cols = vals.shape[1]
    scaled = vals if temperature is None else vals / temperature[:, None]  # [n, K]
    keep = torch.arange(num_cols, device=logits.device) < top_k[:, None]
    if bool((top_p < 1.0).any()):
        # Nucleus mass is over the top-k survivors when top-k is on, else the whole vocabulary.
        lse = lse_full
        if lse is None:
            lse = sampling.row_logsumexp(scaled.masked_fill(~keep, float("-inf")))
        probs = (scaled - lse[:, None]).exp_().masked_fill_(~keep, 0.0)
        mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
        keep &= mass_before < (top_p[:, None] - _TOP_P_EPS)
        keep[:, 0] = True  # the most likely token always survives
    if num_cols >= vocab:
        exact = torch.ones(n, dtype=torch.bool, device=logits.device)
    else:
        # Tokens outside the slice are <= its last value; only a tie with the last kept value
        # (or a kept set filling the slice) can make one of them belong to the kept set.
        last = (keep.sum(dim=-1) - 1).clamp_(min=0)
        exact = vals[:, -1] < vals.gather(-1, last[:, None]).squeeze(-1)
    # min-p after top-p: both keep the top token, so the max prob it refers to is unchanged.
    keep &= (scaled - scaled[:, :1]).exp_() >= min_p[:, None]
    return scaled.masked_fill_(~keep, float("-inf")), ids, exact


def _row_params(
    params: list[SamplingParams], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature, top_k with V = disabled, top_p, min_p), one host->device copy."""
    table = torch.tensor(
        [
            [p.temperature, p.top_k if 0 < p.top_k < vocab else vocab, p.top_p, p.min_p]
            for p in params
        ],
        dtype=torch.float64,
    )
    table = upload(table, device)
    return table[:, 0].float(), table[:, 1].long(), table[:, 2].float(), table[:, 3].float()


# One group: (rows of the input, scores [m, K] with dropped tokens at -inf, token ids [m, K] or
# [V] when the columns are the vocabulary itself).
_Group = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _filtered(logits: torch.Tensor, params: list[SamplingParams]) -> list[_Group]:
    """Temperature, top-k, top-p and min-p for sampled (T > 0) rows of penalised logits.

    Three groups, each with its own candidate width: rows with no top-k/top-p race over the
    whole vocabulary (no sort), top-k rows over k + 1 candidates, top-p-only rows over a
    histogram bound on their nucleus.
    """
    n, vocab = logits.shape
    device = logits.device
    groups: list[_Group] = []
    kinds = [0 if 0 < p.top_k < vocab else (1 if p.top_p < 1.0 else 2) for p in params]
    for kind in (0, 1, 2):
        sel = [i for i, k in enumerate(kinds) if k == kind]
        if not sel:
            continue
        rows = upload(torch.tensor(sel), device)
        whole = len(sel) == n  # then sub is the caller's tensor: never scale it in place
        sub = logits if whole else logits[rows]  # [m, V]; indexing beats index_select on CPU
        temperature, top_k, top_p, min_p = _row_params([params[i] for i in sel], vocab, device)
        if kind == 2:
            scaled = sub / temperature[:, None] if whole else sub.div_(temperature[:, None])
            if any(params[i].min_p > 0 for i in sel):
                ratio = (scaled - scaled.max(dim=-1, keepdim=True).values).exp_()
                scaled.masked_fill_(ratio < min_p[:, None], float("-inf"))
            groups.append((rows, scaled, torch.arange(vocab, device=device)))
            continue
        lse_full = None
        if kind == 0:
            num = max(params[i].top_k for i in sel) + 1  # spare column: see `exact`
        else:
            sub = sub / temperature[:, None] if whole else sub.div_(temperature[:, None])
            temperature = None  # sub is scaled already
            lse_full = sampling.row_logsumexp(sub)
            num = int(_nucleus_bound(sub, lse_full, top_p).max()) + 1
        scores, ids, exact = _candidates(
            sub, temperature, top_k, top_p, min_p, lse_full, min(num, vocab)
        )
        if bool(exact.all()):
            groups.append((rows, scores, ids))
            continue
        ok, bad = exact.nonzero().squeeze(1), (~exact).nonzero().squeeze(1)
        groups.append((rows[ok], scores[ok], ids[ok]))
        full = _candidates(
            sub[bad],
            None if temperature is None else temperature[bad],
            top_k[bad],
            top_p[bad],
            min_p[bad],
            None if lse_full is None else lse_full[bad],
            vocab,
        )
        groups.append((rows[bad], full[0], full[1]))
    return groups


def allowed_mask(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[n, V] bool: tokens a row may sample after temperature, top-k, top-p and min-p.

    logits are already penalised. Greedy rows allow only their argmax. Runs the sampler's own
    filtering code, so tests of this mask test the sampler.
    """
    n, vocab = logits.shape
    device = logits.device
    mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    greedy = [i for i, p in enumerate(params) if p.temperature < _SAMPLING_EPS]
    if greedy:
        g_idx = torch.tensor(greedy, device=device)
        mask[g_idx, logits.index_select(0, g_idx).argmax(dim=-1)] = True
    sampled = [i for i, p in enumerate(params) if p.temperature >= _SAMPLING_EPS]
    if sampled:
        s_idx = torch.tensor(sampled, device=device)
        for rows, scores, ids in _filtered(
            logits.index_select(0, s_idx), [params[i] for i in sampled]
        ):
            allowed = scores > float("-inf")
            if ids.dim() == 2:  # candidate columns -> vocabulary columns
                allowed = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device).scatter_(
                    1, ids, allowed
                )
            mask[s_idx[rows]] = allowed
    return mask


# ---------------------------------------------------------------------------------------------
# Sampler


class Sampler:
    """Stateless apart from the unseeded-seed source; safe to share across steps."""

    def __call__(
        self,
        logits: torch.Tensor,  # [num_seqs, vocab] float32
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
    ) -> SamplerOutput:
        assert logits.dim() == 2, f"logits must be [num_seqs, vocab], got {tuple(logits.shape)}"
        n, vocab = logits.shape
        assert len(params) == len(prompt_token_ids) == len(output_token_ids) == n
        device = logits.device
        raw = logits.float()  # no copy when already float32; never modified in place

        has_penalty = any(
            p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params
        )
        proc = (
            apply_penalties(raw, params, prompt_token_ids, output_token_ids) if has_penalty else raw
        )
        if any(p.logit_bias_ids for p in params):
            if proc is raw:  # raw may be the caller's tensor: never written
                proc = raw.clone(memory_format=torch.contiguous_format)
            proc = apply_logit_bias(proc, params)
        # Rows still short of min_tokens; `p.min_tokens and` keeps the common path to one
        # attribute read per row.
        short = [
            i
            for i, p in enumerate(params)
            if p.min_tokens and len(output_token_ids[i]) < p.min_tokens
        ]
        if short:
            if proc is raw:  # raw may be the caller's tensor: never written
                proc = raw.clone(memory_format=torch.contiguous_format)
            proc = apply_min_tokens(proc, params, short)

        sampled = [i for i, p in enumerate(params) if p.temperature >= _SAMPLING_EPS]
        # fp32 CPU logits: argmax and logsumexp of the raw rows in one compiled pass (else None).
        fused = sampling.argmax_logsumexp(raw)
        if not sampled and fused is not None and proc is raw:
            token_ids = fused[0]  # all greedy, nothing applied: the raw rows' argmax
        elif not sampled:
            token_ids = proc.argmax(dim=-1)  # fast path: no gathers, no noise
        else:
            token_ids = torch.empty(n, dtype=torch.int64, device=device)
            greedy = [i for i, p in enumerate(params) if p.temperature < _SAMPLING_EPS]
            if greedy:
                g_idx = upload(torch.tensor(greedy), device)
                token_ids[g_idx] = proc[g_idx].argmax(dim=-1)
        if sampled:
            s_idx = upload(torch.tensor(sampled), device)
            keys = torch.tensor(
                [
                    row_key(
                        s if (s := params[i].seed) is not None else _seed_source.getrandbits(63),
                        len(output_token_ids[i]),  # output position: survives chunking/resume
                    )
                    for i in sampled
                ],
                dtype=torch.int32,
            )  # [num_sampled, 2]
            keys = upload(keys, device)
            sub = proc if len(sampled) == n else proc[s_idx]
            for rows, scores, ids in _filtered(sub, [params[i] for i in sampled]):
                col = race(scores, ids, keys[rows])
                tok = col if ids.dim() == 1 else ids.gather(-1, col[:, None]).squeeze(-1)
                token_ids[s_idx[rows]] = tok

        # Logprobs come from the raw model distribution, whatever the sampling did.
        lse = fused[1] if fused is not None else torch.logsumexp(raw, dim=-1)  # [n]
        logprobs = raw.gather(-1, token_ids[:, None]).squeeze(-1) - lse
        max_n = min(max((p.num_logprobs for p in params), default=0), vocab)
        top_ids = top_lps = None
        if max_n > 0:
            top_vals, top_ids = torch.topk(raw, max_n, dim=-1)  # sorted, most likely first
            top_lps = top_vals - lse[:, None]
        return SamplerOutput(token_ids, logprobs, top_ids, top_lps)
