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
