"""What a generation's steps kept, read and computed, from the methods' own statements (methods/base.py:
selection, kv_kept, rows_computed), summed over its denoising steps (prefills and commits are not
counted) and given as a fraction:

    kv_kept        K/V entries kept or read / of how many; on the block and gemma engines, where a method
                   states nothing, the cached keys each layer's attention read (its selection) / the cache
                   (DiffusionGemma: its full layers; the sliding ones read a window)
    rows_computed  canvas rows computed / of how many, with rows_computed_per_layer where a method
                   states one number per layer

Counts held on the device stay there until `stats` reads them: one sync per generation.
"""

from __future__ import annotations

import torch


def prefix_keys_read(method, ctx) -> tuple[int, int]:
    """(prefix keys this step's attention read, of how many), over the layers the cache holds and the
    rows: a layer whose selection was read reads at most its `most` keys of a row. Host lengths: no
    device sync."""
    lengths, layers = ctx.cache.host_lengths, [i for i, keys in enumerate(ctx.cache.keys) if keys is not None]
    read = 0
    for layer in layers:
        chosen = method.selection(layer, ctx)
        read += sum(n if chosen is None or chosen.chosen_now else min(chosen.most, n) for n in lengths)
    return read, len(layers) * sum(lengths)


class Meter:
    def __init__(self):
        self.sums: dict[str, list] = {}  # name -> [numerator, denominator], numbers or device tensors

    def count(self, method, ctx):
        """Add what the step just run stated."""
        kept = method.kv_kept(ctx)
        if kept is None and ctx.cache is not None:
            kept = prefix_keys_read(method, ctx)
        for name, pair in (("kv_kept", kept), ("rows_computed", method.rows_computed(ctx))):
            if pair is not None:
                sums = self.sums.setdefault(name, [0, 0])
                sums[0], sums[1] = sums[0] + pair[0], sums[1] + pair[1]

    def stats(self) -> dict:
        """{name: fraction}, and {name}_per_layer where a method counted per layer."""
        stats = {}
        for name, (part, whole) in self.sums.items():
            fraction = (torch.as_tensor(part, dtype=torch.float64) / max(float(whole), 1e-30)).tolist()
            if isinstance(fraction, list):
                stats[f"{name}_per_layer"] = fraction
                fraction = sum(fraction) / len(fraction)
            stats[name] = fraction
        return stats
