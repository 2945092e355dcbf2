"""The package version; the native module sglite._core must report the same one."""

__version__ = "0.1.0"
