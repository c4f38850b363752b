"""Engram table sizes from a config's Engram fields, in pure Python (no torch).

For each Engram layer, each n-gram order n = 2..max_ngram and each of `n_heads` heads, the hash
modulus is a prime; all buckets of a layer live in one offset table of sum(primes) rows.
`engram_primes` gives the primes (also used by `cedlm.model.engram.EngramHasher`),
`engram_table_rows` the per-layer row counts that `engram_num_embeddings` holds.
"""
from __future__ import annotations


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:                       # deterministic Miller-Rabin for n < 3.3e24
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(layer_ids: list[int], vocab_size: int, max_ngram: int, n_heads: int
                  ) -> dict[int, list[list[int]]]:
    """Per layer, per n-gram order (2..max_ngram), per head: the modulus prime.

    Primes ascend above `vocab_size - 1`, never reused across layers (a global seen set); this
    reproduces the official row counts [384006168, 384016682] from engram_vocab_size 16,000,000.
    """
    seen: set[int] = set()
    out: dict[int, list[list[int]]] = {}
    for layer in layer_ids:
        per_n = []
        for _n in range(2, max_ngram + 1):
            cur, heads = vocab_size - 1, []
            for _h in range(n_heads):
                c = cur + 1
                while c in seen or not _is_prime(c):
                    c += 1
                seen.add(c)
                heads.append(c)
                cur = c
            per_n.append(heads)
        out[layer] = per_n
    return out


def engram_table_rows(layer_ids: list[int], vocab_size: int, max_ngram: int, n_heads: int) -> list[int]:
    """Rows of each layer's Engram table: the sum of its primes over n-gram orders and heads."""
    p = engram_primes(layer_ids, vocab_size, max_ngram, n_heads)
    return [sum(sum(h) for h in p[layer]) for layer in layer_ids]
