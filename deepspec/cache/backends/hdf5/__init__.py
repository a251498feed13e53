"""The HDF5 backend: one file per part (`part` writes it), what h5py needs to read one (`h5`), the
read side (`read`) and the write side (`write`)."""
