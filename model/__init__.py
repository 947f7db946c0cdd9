"""Model engine: config, loaders (GGUF, HF safetensors), tokenizer, Llama-family forward, sampling."""
