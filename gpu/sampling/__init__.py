"""Sampling on the host, in numpy: what a step's logits become (docs/design.md §5).

sampler.py turns a logits matrix and per-row settings into token ids and logprobs (penalties,
temperature, min_p, top_k, top_p, seeds): the CPU runner's sampler, whose semantics the CUDA
sampler (gpu/cuda/sampler.py) follows and whose types it returns; prompt_logprobs.py scores the
extra rows that ``prompt_logprobs`` asks for. It knows nothing of requests."""
