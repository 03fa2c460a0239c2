"""Model formats and loading: from what a user names after ``--model`` to a checked
``ModelConfig`` and weight arrays in memory, for either backend.

model_store.py finds, downloads and caches a model, converting a llama.cpp GGUF file into an
HF-layout folder with gguf_convert.py; config.py reads and checks the model's config.json;
weights.py loads its safetensors (raw GGUF blocks and bfloat16 kept as they are); hf_quant.py
unpacks AWQ/GPTQ int4 checkpoints; quant.py repacks GGUF blocks into the planes both backends'
kernels read. Nothing here computes a forward, and nothing here imports numba or CuPy."""
