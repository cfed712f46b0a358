"""The mount's runtime: what a mount proves before its loop (startup), and the wiring of the
FUSE session, the core, the cache, the flusher and the control socket in one trio loop (daemon)."""
