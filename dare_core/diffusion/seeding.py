"""Derived seeds: every random draw in the masking/likelihood/loss path comes from a generator
seeded by a hash of what it is for, never from a global RNG (docs/diffusion.md#seeding)."""
from __future__ import annotations

import hashlib
from typing import Union

import torch

SeedPart = Union[int, str]


def derive_seed(*parts: SeedPart) -> int:
    """A 63-bit seed from (run_seed, step, sample_uid, inner_iteration, mc_index, purpose, ...)."""
    h = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def generator(*parts: SeedPart, device: Union[str, torch.device] = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*parts))
    return g


def sample_generators(base: tuple, uids: list, device: Union[str, torch.device] = "cpu") -> list[torch.Generator]:
    """One generator per sample, so a sample's draws do not depend on its batch neighbours."""
    return [generator(*base, uid, device=device) for uid in uids]
