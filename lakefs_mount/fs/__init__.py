"""The POSIX core over inodes, callable without a kernel: files and handles (filesystem),
inodes and attributes (inodes), directories and names (names), renames, errnos (errors)."""
