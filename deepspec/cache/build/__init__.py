"""Building a store: the cache stage (`stage`: regen rows -> plan -> each part computed with the
target or derived), its row index (`regen_rows`), and deriving parts from another store (`derive`,
`derive_source`). May import the read and write paths and everything below them."""
