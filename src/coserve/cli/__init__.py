"""The ``coserve`` command line: argument parsing and file I/O around the pure packages."""

from coserve.cli.main import main

__all__ = ["main"]
