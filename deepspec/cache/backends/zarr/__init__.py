"""The Zarr v3 backend: one shard file per array (`shard` encodes it without zarr-python, `layout`
parses its metadata and checks a part for damage), the read side (`read`) and the write side (`write`)."""
