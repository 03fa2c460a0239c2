"""The model side of ringserve: turns a ``Batch`` into sampled token ids; knows nothing of
requests, scheduling or HTTP (docs/design.md §2, §5).

At the top, what every part shares: batch.py (the batch contract with the engine), model.py
(the Llama, written once over a backend's ops) and rope.py (its RoPE tables), bfloat16.py
(bf16 as uint16 bits), runner.py (the ``Runner`` face and the ``ModelRunner`` factory),
settings.py (device and cache settings, StepLimits), devices.py (which backend, which GPUs),
errors.py (``ModelError``). Then one subpackage per concern: loader/ (model formats and
loading), cpu/ and cuda/ (the two backends), sampling/ (host sampling and logprobs)."""
