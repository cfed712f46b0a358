"""The tree of inodes the kernel sees: numbers, names, parents, keys; no S3.

Inode numbers are handed out once and stay with a file for the life of the mount, also
across renames. Listings (listings.py) and attributes (namespace.py) build on it.
"""

from __future__ import annotations

import itertools
import time

from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.namespace.inode import (
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    ROOT_INO,
    Inode,
    Kind,
    kind_of,
)


class Tree:
    def __init__(self, prefix: str, owner: tuple[int, int],
                 modes: tuple[int, int] = (DEFAULT_FILE_MODE, DEFAULT_DIR_MODE)) -> None:
        self.prefix = prefix
        # What entries that carry no attributes of their own show: the mount's owner
        # (--uid/--gid) and modes (--file-mode/--dir-mode, with their type bits).
        self.owner = owner
        self.file_mode, self.dir_mode = modes
        self._next_ino = itertools.count(ROOT_INO + 1)
        now = time.time_ns()
        root = Inode(ROOT_INO, Kind.DIR, ROOT_INO, "", dir_mode=self.dir_mode,
                     dir_uid=owner[0], dir_gid=owner[1], dir_mtime_ns=now, ctime_ns=now)
        self.inodes: dict[int, Inode] = {ROOT_INO: root}

    # -- paths and keys ---------------------------------------------------------------

    def path_of(self, inode: Inode) -> str:
        """Path relative to the mount root, without a leading slash ("" for the root)."""
        parts: list[str] = []
        while inode.ino != ROOT_INO:
            parts.append(inode.name)
            inode = self.inodes[inode.parent]
        return "/".join(reversed(parts))

    def dir_by_key(self, dir_key: str) -> Inode | None:
        """The directory whose key is `dir_key`, if this mount knows it."""
        inode = self.inodes[ROOT_INO]
        for name in dir_key[len(self.prefix):].split("/")[:-1] if dir_key != self.prefix else []:
            child = self.child(inode, name)
            if child is None or not child.is_dir:
                return None
            inode = child
        return inode

    def file_by_key(self, key: str) -> CachedFile | None:
        """The file whose key is `key`, if this mount knows it."""
        parent_key, _, name = key.rpartition("/")
        parent = self.dir_by_key(parent_key + "/" if parent_key else "")
        child = None if parent is None else self.child(parent, name)
        return None if child is None else child.file

    def key_of(self, inode: Inode) -> str:
        path = self.path_of(inode)
        if inode.is_dir:
            return self.prefix + path + "/" if path else self.prefix
        return self.prefix + path

    def get(self, ino: int) -> Inode:
        return self.inodes[ino]

    def child(self, parent: Inode, name: str) -> Inode | None:
        ino = parent.children.get(name)
        return None if ino is None else self.inodes.get(ino)

    # -- creating and moving entries ------------------------------------------------

    def add(self, parent: Inode, name: str, kind: Kind, file: CachedFile | None = None,
            **dir_attrs: int) -> Inode:
        ino = next(self._next_ino)
        inode = Inode(ino, kind, parent.ino, name, file=file, ctime_ns=time.time_ns(),
                      **dir_attrs)  # type: ignore[arg-type]
        if kind is Kind.DIR:
            inode.listed_at = 0.0
        self.inodes[ino] = inode
        self._set_child(parent, name, inode)
        return inode

    def add_listed_dir(self, parent: Inode, name: str) -> Inode:
        """A directory that S3 (or the journal) has: its attributes are loaded before the
        kernel sees it (ensure_headed); till then the mount's owner and defaults."""
        uid, gid = self.owner
        inode = self.add(parent, name, Kind.DIR, dir_mode=self.dir_mode, dir_uid=uid,
                         dir_gid=gid, dir_mtime_ns=time.time_ns())
        inode.headed = False
        return inode

    def detach(self, inode: Inode) -> None:
        """Remove a name; the inode lives on while the kernel still references it."""
        parent = self.inodes.get(inode.parent)
        if parent is not None:
            self._drop_child(parent, inode)
        if inode.lookups <= 0 and inode.ino != ROOT_INO:
            self.inodes.pop(inode.ino, None)

    def move(self, inode: Inode, new_parent: Inode, new_name: str) -> None:
        self._drop_child(self.inodes[inode.parent], inode)
        inode.parent, inode.name = new_parent.ino, new_name
        self._set_child(new_parent, new_name, inode)
        inode.ctime_ns = time.time_ns()

    def _set_child(self, parent: Inode, name: str, inode: Inode) -> None:
        replaced = self.child(parent, name)
        if replaced is not None and replaced.is_dir:
            parent.subdirs -= 1
        parent.children[name] = inode.ino
        if inode.is_dir:
            parent.subdirs += 1

    def _drop_child(self, parent: Inode, inode: Inode) -> None:
        if parent.children.get(inode.name) == inode.ino:
            del parent.children[inode.name]
            if inode.is_dir:
                parent.subdirs -= 1

    def forget(self, ino: int, count: int) -> None:
        inode = self.inodes.get(ino)
        if inode is None or ino == ROOT_INO:
            return
        inode.lookups -= count
        parent = self.inodes.get(inode.parent)
        attached = parent is not None and parent.children.get(inode.name) == ino
        if inode.lookups <= 0 and not attached:
            del self.inodes[ino]

    def descendants(self, inode: Inode) -> list[Inode]:
        out: list[Inode] = []
        stack = [inode]
        while stack:
            node = stack.pop()
            for ino in node.children.values():
                child = self.inodes.get(ino)
                if child is not None:
                    out.append(child)
                    if child.is_dir:
                        stack.append(child)
        return out

    def attach_path(self, path: str, file: CachedFile) -> Inode:
        """Place a recovered file at its path, creating directories only known locally."""
        *dirs, name = path.split("/")
        parent = self.inodes[ROOT_INO]
        for part in dirs:
            child = self.child(parent, part)
            if child is None or not child.is_dir:
                child = self.add_listed_dir(parent, part)
            parent = child
        existing = self.child(parent, name)
        if existing is not None:
            self.detach(existing)
        return self.add(parent, name, kind_of(file), file=file)
