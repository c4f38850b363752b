"""Text side of cedlm: tokenizer (byte-level BPE, official DeepSeek vocabulary), chat encoding and
the corpus document format (`documents`)."""
