"""The read path: `reader` (CacheReader: every committed part of a store, random access, every
declared size checked against the manifest), `shards` (the byte-range fast path), `ranges` (pread and
fsspec byte ranges), `checks` (crc32c on helper threads), `samples` (samples as tensors). May import
`backends`, `storage` and `spec`; never the write path."""
