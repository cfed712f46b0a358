"""The FUSE sessions: the native /dev/fuse session (native/) and the pyfuse3 adapter
(pyfuse3_ops); both translate kernel requests into calls of the kernel-free `fs` core."""
