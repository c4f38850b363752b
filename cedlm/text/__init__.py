"""Text side of cedlm: tokenizer (byte-level BPE, official DeepSeek vocabulary) and chat encoding."""
