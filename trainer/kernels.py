"""Which kernels this process computes with: a short fingerprint a run records in every
round's start state (``round/kernels``) and a verifier prints beside its own.

Two processes with the same fingerprint ran the same float32 kernels on the same inputs
to the same bits (as far as a probe can tell); different ones may differ in the last bits
of a native run's inner steps, never of a portable run's (`parallel.numerics`), and never
of the aggregate levels (trainer/diloco.py computes those in float64, rounded once).

    AVX2 x86_64 torch 2.13.0+cpu probe 3f0c9a1e

The capability is ATen's kernel set (`ATEN_CPU_CAPABILITY` may lower it), the probe a
hash of float32 kernels whose bits move with the instruction set, the math libraries'
dispatch and the thread count: a matmul, a softmax, exp, tanh, a row sum, GELU (oneDNN's
under some settings) and a layer norm, on fixed inputs drawn
with torch.rand (whose bits do not depend on the kernels)."""

from __future__ import annotations

import functools
import hashlib
import platform

import torch

__all__ = ["kernel_fingerprint"]


@functools.cache
def kernel_fingerprint() -> str:
    """This process's kernel fingerprint (see the module docstring); cached: the kernels
    of a process do not change."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(128, 256, generator=g) - 0.5, torch.rand(256, 192, generator=g) - 0.5
    with torch.no_grad():
        outs = [a @ b, torch.softmax(a, dim=1), torch.exp(a), torch.tanh(b), a.sum(dim=1),
                torch.nn.functional.gelu(a), torch.nn.functional.layer_norm(a, (256,))]
    digest = hashlib.sha256()
    for t in outs:
        digest.update(t.contiguous().numpy().tobytes())
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{capability} {platform.machine()} torch {torch.__version__} probe {digest.hexdigest()[:8]}"
