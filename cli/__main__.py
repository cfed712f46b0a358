"""`python -m lakefs_mount.cli`: the `lakefs-mount` command, where its script is not at
hand (the mount(8) helper runs it so)."""

from lakefs_mount.cli import main

if __name__ == "__main__":
    main()
