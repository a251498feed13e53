"""The cache's vocabulary: the on-disk format's names, dtypes, encodings and content keys (`format`),
the typed and validated root manifest (`manifest`), and the part plan, a pure function of the input
(`plan`). Imports nothing of the cache; everything else in it imports this."""
