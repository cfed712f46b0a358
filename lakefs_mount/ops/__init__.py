"""What operators and commands talk to: the control socket (control, controlclient),
Prometheus metrics (metrics_server), systemd readiness (sdnotify), mount point checks
(mountpoint), orphaned cache files (orphans) and per-checkpoint progress (dirprogress)."""
