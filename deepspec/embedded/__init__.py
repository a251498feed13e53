"""The embedded default: what `make repro` runs with no GPU, no hub and no data of your own.

`corpus.py` is the packaged `builtin:chat` corpus (real chat plus generated math, code and
instruction rows); `tiny.py` trains the `builtin:tiny` target (a narrow Qwen3) on its train side
and extra generated rows, with `muon.py` as its optimiser. A pipeline on a real model and dataset
runs none of this. Importing the package registers `builtin:chat` as a split source.
"""
from deepspec.data.sources import register_source
from deepspec.embedded.corpus import builtin_chat_rows

register_source("builtin:chat", builtin_chat_rows)
