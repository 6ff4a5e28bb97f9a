"""What test modules share, so that no test module imports another (``from helpers.cases import case``: pytest puts
tests/ on ``sys.path``, as tests/ is no package; bench/flash_emulation_check.py puts it there itself).

- ``cases``: the kernel's reference cases -- :func:`~helpers.cases.case`, :func:`~helpers.cases.expected` (the float64
  dense reference), :func:`~helpers.cases.attend` (the kernel's call on a case), ``BASELINES``, ``DISTANCE_METHODS``.
- ``gradients``: the methods and the comparison of gradients against the reference's.
- ``paged``: a paged cache of mixed requests in vLLM's layout, its reference, and the CUDA backend's algorithm run
  through the emulated FlashAttention.
- ``flash_emulation``: FlashAttention's paged varlen call and vLLM's merge, in float64 on the CPU.
- ``toy_backend``: a backend in one file (tests/test_backends.py registers it).
- ``tiny_models``: tiny models of several RoPE families, a byte-level tokenizer, the saved models of the lm-eval,
  torchrun and vLLM tests.
- ``model_cases``: methods applied to tiny models, the cache families, left-padded inputs.
- ``lm_eval_tasks``: lm-eval's local tasks, written offline.
- ``memory``: peak memory of a probe in a process of its own.
- ``native``: whether the C++ CPU kernel builds here.
"""
