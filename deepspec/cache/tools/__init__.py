"""The `deepspec cache` tools: `verify` (and recompute), `gc`, `convert`, `estimate`, and the
reference-format import and export (`reference`, `reference_cache`). The top of the cache."""
