"""Where stores live and how bytes reach them durably: URLs and local paths, links kept inside a store
(`urls`); fsync and crash-atomic replacement on local disk (`durable`); Zarr stores opened with S3
conditional writes and the precondition codes (`fenced`); store naming and lake listing (`naming`);
the byte-bounded LRU readers keep tables in (`bounded`); the writer's process-wide thread pools
(`pools`). May import `spec` only."""
