"""Inodes and names <-> S3 keys: the inode table, listings and lookups, directory
attributes and indexes, and the namespace changes written back to S3 in order (namelog)."""
