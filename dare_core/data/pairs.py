"""Why a prepared dataset holds no preference pairs: the one explanation that prepare (a warning, or
the error under `preference.enabled: true`) and the preference stage (when it turns itself off) give."""
from __future__ import annotations

from typing import Any


def why_no_pairs(cfg: Any) -> str:
    """Why the prepared data holds no preference pairs, from the settings that make them."""
    if cfg.data.preference_source:
        return f"data.preference_source ({cfg.data.preference_source}) has none outside the test prompts"
    if cfg.data.num_preference <= 0:
        return "data.num_preference is 0 and no data.preference_source is set"
    return ("no training row has an answer with a digit to change (pairs are derived only from numeric answers); "
            "give pairs of your own in data.preference_source")


def pairs_required(cfg: Any, where: str) -> str:
    """The error when `preference.enabled: true` finds no pairs at `where` (prepare, or the stage)."""
    return (f"{where}: no preference pairs, but preference.enabled is true: {why_no_pairs(cfg)} (or set "
            f"preference.enabled: auto, which turns the stage off without pairs)")

