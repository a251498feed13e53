"""The write path: `writer` (CacheWriter: parts committed one by one, the root replaced once),
`process_writer` (the same writer in a child process, `process_serve`, started by `process_child`
and fed through the memory files of `shared_buffers`: what a GPU's capture writes through), `part_data` (what a writer is handed,
whole or streamed), `lease` (one writing job per store: the local lock, and the S3 lease in
`lease_s3`; the holder's identity and bounded ttl in `holder`). May import `backends`, `storage` and
`spec`; never the read path."""
