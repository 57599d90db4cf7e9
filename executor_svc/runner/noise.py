"""Counter-based noise for seeded sampling: a uniform for every (seed, output position, token
id), the same whatever else is in the batch, on CPU and CUDA alike; sampling races p_i / E_i
(E ~ Exp(1)), so a seeded row's token depends only on its own logits and key."""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _i32(x: int) -> int:
    """Unsigned 32-bit constant as the signed value torch's int32 arithmetic wraps with."""
    return x - (1 << 32) if x >= 1 << 31 else x


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> tuple[int, int]:
    """Two int32 keys for one (seed, output position); pure Python, once per row."""
    h = _splitmix64(_splitmix64(seed & _MASK64) ^ position)
    return _i32(h & 0xFFFFFFFF), _i32(h >> 32)


_GOLDEN32 = _i32(0x9E3779B9)
_FMIX_C1 = _i32(0x85EBCA6B)
_FMIX_C2 = _i32(0xC2B2AE35)


def uniform_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) for each (row key, token id).

    keys: [n, 2] int32 from row_key; token_ids: [n, K] or [K]. Returns [n, K] float32.
    A murmur3 fmix32 finaliser in int32 (torch wraps int32 multiplication the same on CPU and
    CUDA; right shifts are arithmetic, hence the masks). The second key is mixed in mid-way so
    that rows whose first keys differ by a multiple of the id stride are not shifted copies.
    32-bit ops are ~6x cheaper than 64-bit ones on CPU, and only 23 bits are used anyway.
    """
    z = token_ids.to(torch.int32) * _GOLDEN32
    z = z + keys[:, :1]
    z ^= (z >> 16) & 0xFFFF
    z *= _FMIX_C1
    z ^= keys[:, 1:]
    z ^= (z >> 13) & 0x7FFFF
    z *= _FMIX_C2
    z ^= (z >> 16) & 0xFFFF
    # Top 23 bits: k + 0.5 is exact in float32, so u never rounds to 0 or 1 (E would be inf/0).
    u = (z >> 9).to(torch.float32)  # [-2^22, 2^22)
    return u.add_(2.0**22 + 0.5).mul_(2.0**-23)


def race(scores: torch.Tensor, token_ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Column index of argmax p_i / E_i; scores are log p up to a per-row constant."""
    log_e = uniform_noise(keys, token_ids).log_().neg_().log_()  # log(E), E = -log(u) ~ Exp(1)
    return torch.argmax(scores - log_e, dim=-1)
