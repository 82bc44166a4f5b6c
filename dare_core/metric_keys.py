"""How a logged update metric combines over chunks of rows, micro-batches and ranks, read from its
key: a `*_max` key (e.g. ratio_max) by max, since a mean hides the one sequence that spikes; every
other update metric by the weighted mean (or, over chunks of one micro-batch, by the sum of shares)."""


def is_max_metric(key: str) -> bool:
    return key.endswith("_max")


def add_chunk_metrics(total: dict, part: dict) -> dict:
    """Fold one chunk's metrics into `total` (in place): shares summed, `*_max` keys by max."""
    for k, v in part.items():
        total[k] = max(total[k], v) if is_max_metric(k) and k in total else total.get(k, 0.0) + v
    return total
