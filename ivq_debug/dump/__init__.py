"""The HDF5 golden-dump format: streaming atomic writer, lazy reader, manifest (``docs/dump-format.md``)."""

from ivq_debug.dump.reader import Dump, Entry, block_slices, open_dump
from ivq_debug.dump.writer import DumpWriter, check_writable

__all__ = ["Dump", "DumpWriter", "Entry", "block_slices", "check_writable", "open_dump"]
