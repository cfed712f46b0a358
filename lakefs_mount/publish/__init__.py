"""Publication of checkpoints: `commit` (publisher) writes a manifest (manifest) as the
last object, `verify` checks one, `--commit-on-rename` (autocommit) commits by itself."""
