"""A property-based fuzzer of stores written by anyone (docs/cache-format.md §13, DESIGN.md §12): the
harness tests/cache/test_fuzz.py (CI, a fixed seeded set) and benchmarks/fuzz_stores.py (N cases,
a table) share.

A case copies a small pristine store (built once per backend and variant: Zarr or HDF5, local or on
S3, bfloat16 uncompressed or fp8 + blosc-zstd; 2 parts, 5 samples), applies 1-3 hostile mutations
(`Mutation`: JSON fields, truncation, bit flips, links in and out of the store, /dev/zero, FIFOs,
directories, sparse or oversized files, duplicated names and keys, deleted files, index rows and
shard indexes rewritten with valid checksums), then reads it through the library in one or more
modes (`CacheReader(fast=True)` always; `fast=False` and `tools.verify.verify` for a drawn subset)
and checks, for every mode:

  1. it returns the pristine store's samples (len, every array of every sample with its dtype and
     shape, every sample id) or raises CacheFormatError (its subclasses ChecksumError, LeaseError, ...
     included) whose message names the store (its URL or path); any other exception is a failure;
  2. nothing outside the store is opened (what is recorded, and what is not, below);
  3. the tracemalloc peak above what was held when the mode started stays under `MEMORY_BOUND`
     (less for a case with an oversized object: a quarter of that object);
  4. it ends within its timeout: `signal.setitimer` raises `CaseTimeout` in the main thread (it
     interrupts a blocking open of a FIFO there), FIFOs of the case are then opened for writing and
     closed so a reader blocked on one in a helper thread (zarr's I/O threads) gets EOF, and
     `faulthandler.dump_traceback_later(..., exit=True)` is the backstop that kills the process
     loudly if the main thread is stuck where no signal handler runs. (A mode cut short may leave a
     lock of the library held or a request in flight: cases after a hang may fail for that reason.)

Recorded for 2, only while a mode runs (`Recorder.active`; audit hooks cannot be removed, so the
hook is installed once per process and does nothing otherwise), from any thread:
  - the audit events `open` (builtins.open, io.open, os.open, and io.open_code of imports),
    `os.listdir` and `os.scandir`, each path resolved with os.path.realpath when the event fires;
  - h5py's file opens (HDF5 opens files in C, unaudited): a wrapper around h5py._hl.files.make_fid
    records the name of every h5py.File opened by name (a file object handed to h5py was opened,
    and recorded, by Python);
  - on S3, every request s3fs makes (S3FileSystem._call_s3: its Bucket and Key, Prefix or
    CopySource), which must lie under the case's store prefix.
  Allowed beside the case's store: Python's stdlib, the venv's site-packages and this checkout's
  deepspec/ (modules imported lazily), /dev/urandom, /proc/self (`ALLOWED_FILES`).
Not recorded: stat/lstat/exists/realpath/readlink (no audit event: metadata only, no bytes), an mmap
of a descriptor (its open was recorded), files opened in C by other libraries (blosc, hdf5plugin's
dlopen of filters), anything a child process does.

The harness only ever reads or rewrites regular files of the case's own copy; a mutation whose file
an earlier mutation turned into something else (a link, a FIFO, a directory) is skipped and says so.

The modules, in the order a case meets them:
  - stores.py: the pristine stores, the samples they read as (`differs`), a case's copy of its store
    (local, or on S3 and put back after the case);
  - mutations.py: the hostile values, `Mutation`, the kinds each backend has and their strategies;
  - edits.py: how each mutation kind is applied to a case's copy (`apply`);
  - watch.py: the recorders of opens and S3 requests, what may be opened, timeouts, tracemalloc;
  - check.py: one mode read and judged against the property (`read_mode`, `run_mode`, `ModeResult`);
  - harness.py: `Case` and its strategy `cases`, `Outcome`, and `Harness`, which runs a case;
  - report.py: property failures grouped by class and where they were raised.
The names callers use are re-exported here. A test that replaces a function or a setting does so in
the module that looks it up (check.read_mode and check.TIMEOUT_LOCAL_S, say), not here.
"""
from __future__ import annotations

from tests.cache.fuzz.check import MEMORY_BOUND, ModeResult, read_mode, run_mode
from tests.cache.fuzz.edits import apply
from tests.cache.fuzz.harness import Case, Harness, Outcome, cases
from tests.cache.fuzz.mutations import Mutation, kinds_for, mutation, mutation_of
from tests.cache.fuzz.report import failure_class, failure_groups, format_groups
from tests.cache.fuzz.stores import BACKENDS, VARIANTS, Pristine, build_pristine, differs, scratch
from tests.cache.fuzz.watch import RECORDER, install_recorders, outside

__all__ = ["BACKENDS", "MEMORY_BOUND", "RECORDER", "VARIANTS", "Case", "Harness", "ModeResult", "Mutation",
           "Outcome", "Pristine", "apply", "build_pristine", "cases", "differs", "failure_class",
           "failure_groups", "format_groups", "install_recorders", "kinds_for", "mutation", "mutation_of",
           "outside", "read_mode", "run_mode", "scratch"]
