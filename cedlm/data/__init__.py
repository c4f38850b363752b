"""Training corpus: registry sources, cleaning, deterministic split, manifest (see corpus.py)."""
