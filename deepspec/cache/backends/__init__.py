"""The two store kinds behind one interface: `base` (CacheStore reads, WritableStore writes, the
array layout the fast path uses), `zarr/` and `hdf5/` (each a read side and a write side), and the
registries that open a store of either kind to read (`readers`) or to write (`writers`). May import
`storage` and `spec`."""
