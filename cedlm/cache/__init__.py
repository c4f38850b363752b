"""Persistence for sequence caches: checksummed entry store (directory / Redis) and prefix-block hashes."""
from cedlm.cache.prefix import block_hashes, model_fingerprint
from cedlm.cache.store import (CorruptRecord, DirStore, Record, RedisStore, Store, StoreConnectionError,
                               decode_record, encode_record, open_store)

__all__ = ["block_hashes", "model_fingerprint", "Record", "Store", "DirStore", "RedisStore", "open_store",
           "encode_record", "decode_record", "CorruptRecord", "StoreConnectionError"]
