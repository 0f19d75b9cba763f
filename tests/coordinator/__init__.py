"""Unit tests of the coordinator, one file per module."""
