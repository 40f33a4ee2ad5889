"""What a cloud model's work costs on a GPU: a model, not a measurement (docs/server.md, "What it
costs on a GPU").

Decoding is memory-bound: every forward pass reads all the weights once, so a pass costs the
weights' bytes over the GPUs' bandwidth (at ~70% of peak), and each token in it adds its compute
(2 FLOP per weight at ~50% of bf16 dense peak). A pass of k <= ~32 tokens costs about one decode
step. The model is parameterised by model size, so a pool's tiers (an 8B and a 70B, say) are
priced by one rule: the replay's report, the evals and the `cost` decision engine all use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GPU_MEMORY_GB = 80.0  # one H100 SXM
GPU_BANDWIDTH_TBS = 3.35  # its HBM3 bandwidth (datasheet)
GPU_BF16_TFLOPS = 989.0  # its dense bf16 peak (datasheet)
BANDWIDTH_USE, COMPUTE_USE = 0.7, 0.5
WEIGHTS_SHARE = 0.5  # of the GPUs' memory for the weights; the rest holds KV caches


@dataclass(frozen=True, slots=True)
class GpuCostModel:
    """One model served in bf16 with tensor parallelism on `gpus` H100s."""

    params_b: float = 70.6  # billions of parameters (Llama-3.1-70B)
    gpus: int = 4
    bytes_per_weight: float = 2.0  # bf16

    @classmethod
    def for_size(cls, params_b: float) -> GpuCostModel:
        """The fewest GPUs (a power of two) whose memory holds the weights in WEIGHTS_SHARE of it:
        an 8B model on 1 H100, a 70B on 4."""
        if not params_b > 0:
            raise ValueError(f"a model size must be a positive number of billions of parameters, not {params_b}")
        need = params_b * 2.0 / (GPU_MEMORY_GB * WEIGHTS_SHARE)
        return cls(params_b, 2 ** max(0, math.ceil(math.log2(need))) if need > 1 else 1)

    @property
    def pass_s(self) -> float:
        """Wall time of one memory-bound pass: all weights over all GPUs' bandwidth."""
        return self.params_b * 1e9 * self.bytes_per_weight / (self.gpus * GPU_BANDWIDTH_TBS * 1e12 * BANDWIDTH_USE)

    @property
    def token_s(self) -> float:
        """Wall time each token adds to a pass: its compute over all GPUs."""
        return 2 * self.params_b * 1e9 / (self.gpus * GPU_BF16_TFLOPS * 1e12 * COMPUTE_USE)

    def gpu_seconds(self, passes: float, tokens: float) -> float:
        """GPU-seconds of `passes` forward passes carrying `tokens` tokens in all."""
        return self.gpus * (passes * self.pass_s + tokens * self.token_s)

    def gpu_ms_per_ask(self) -> float:
        """GPU-milliseconds of asking this model for one token (one pass of one token): what a
        per-token decision spends when it sends a position up."""
        return 1000.0 * self.gpu_seconds(1, 1)


PRODUCTION_CLOUD = GpuCostModel()  # the 70B on 4 x H100 that docs/server.md prices
MIDDLE_TIER_B = 8.0  # a pool's tiers between the device and the production model: 8B models


def default_tier_sizes(n_cloud: int) -> list[float]:
    """The sizes (billions) of a pool's cloud tiers, lowest first, where none are given: the production
    70B on top and 8B tiers below it (a pair: the production model alone)."""
    return [MIDDLE_TIER_B] * (n_cloud - 1) + [PRODUCTION_CLOUD.params_b]


def parse_tier_sizes(text: str, n_cloud: int) -> list[float]:
    """`8/70.6` -> [8.0, 70.6], one size per cloud tier, lowest first (ValueError naming what is wrong)."""
    try:
        sizes = [float(x) for x in text.split("/")]
    except ValueError:
        raise ValueError(
            f"model sizes are numbers of billions of parameters, one per tier: 8/70.6, not {text!r}"
        ) from None
    if len(sizes) != n_cloud or not all(x > 0 for x in sizes):
        raise ValueError(
            f"{text!r} names {len(sizes)} model sizes for a pool of {n_cloud} cloud tiers "
            "(positive billions of parameters, one per tier, lowest first: 8/70.6)"
        )
    return sizes
