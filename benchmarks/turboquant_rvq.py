"""TurboQuant RVQ's distortion beside plain TurboQuant_mse, on Gaussian vectors.

For each stage width ``b``, on ``--vectors`` vectors of i.i.d. N(0, 1) entries at head dim
``--dim``, this prints the mean ``||x - x_hat||^2 / ||x||^2`` of:

- ``mse b``: TurboQuant_mse at ``b`` bits (stage 1 alone);
- ``rvq b+b``: ``key_variant="rvq"`` at ``2b`` bits (stage 1, then the Laplacian stage on the
  residual, its scale by VeloxQuant-MLX's rule);
- ``mse 2b``: TurboQuant_mse at ``2b`` bits, the Lloyd-Max codebook of the same width;
- ``rvq fit``: the two stages with the Laplacian's scale set from the measured stage-1 error
  (its standard deviation over sqrt(2)), to tell the scale rule's share of the gap;

and the stage-1 error's measured standard deviation beside the rule's ``sigma_q`` (both times
``sqrt(dim)``).

    python benchmarks/turboquant_rvq.py
"""

from __future__ import annotations

import argparse
import math

import mlx.core as mx
import numpy as np

from velox_turboquant import TurboQuant
from velox_turboquant.residual import MAX_STAGE_BITS, ResidualCodebook, residual_scale


def distortion(x: mx.array, x_hat: mx.array) -> float:
    err = mx.sum((x_hat - x) ** 2, -1) / mx.sum(x * x, -1)
    return float(mx.mean(err).item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--vectors", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    d = args.dim
    x = np.random.default_rng(args.seed).standard_normal((args.vectors, d)).astype(np.float32)
    x = mx.array(x[None, None])

    def coded(codec: TurboQuant) -> float:
        return distortion(x, codec.decode(codec.encode(x)))

    print(f"d = {d}, {args.vectors} Gaussian vectors, seed {args.seed}")
    print("| b | mse b | rvq b+b | mse 2b | rvq fit | stage-1 error std | rule's sigma_q |")
    print("|---|---|---|---|---|---|---|")
    for b in range(1, MAX_STAGE_BITS + 1):
        plain, rvq, wide = TurboQuant(b), TurboQuant(2 * b, "rvq"), TurboQuant(2 * b)
        row = [coded(plain), coded(rvq), coded(wide)]
        # the same rotation and stage 1 as the rvq codec, the second stage's scale fitted
        quant = rvq.parts[0][1]
        norm = mx.sqrt(mx.sum(x * x, -1, keepdims=True))
        y = quant.rotation.forward(x / norm)
        first = quant.codebook.first
        err = y - first.decode(first.encode(y))
        std = float(mx.sqrt(mx.mean(err * err)).item())
        fit = ResidualCodebook(b, d, scale=std / math.sqrt(2))
        row.append(distortion(x, quant.rotation.inverse(fit.decode(fit.encode(y))) * norm))
        sigma_q = residual_scale(b, d) * math.sqrt(2)
        cells = [f"{v:.4g}" for v in row] + [f"{std * d**0.5:.3f}", f"{sigma_q * d**0.5:.3f}"]
        print(f"| {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
