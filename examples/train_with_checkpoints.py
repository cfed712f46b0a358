"""A small training loop that checkpoints to a lakefs-mount mount and resumes from it.

    python examples/train_with_checkpoints.py --ckpt-dir /mnt/ckpt/run1 --steps 200

Every `--every` steps it writes `tmp-checkpoint-N/` (model + optimizer + RNG state +
trainer_state.json), renames it to `checkpoint-N/` (the pattern of the Hugging Face
Trainer and Megatron: a checkpoint directory exists only once complete), points the
`latest` symlink at it and deletes checkpoints beyond `--keep`. At the end it runs
`lakefs-mount flush MOUNTPOINT` so that every checkpoint is in S3 before it exits.
Started again with the same `--ckpt-dir`, it resumes from `latest` (or, if the link is
missing, from the highest complete `checkpoint-N/`). CPU only, random data.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def find_mountpoint(path: Path) -> Path:
    """The mount point that holds `path` (the nearest ancestor that is a mount)."""
    path = Path(os.path.abspath(path))
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 1))


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    link = ckpt_dir / "latest"
    if link.is_symlink():
        target = ckpt_dir / os.readlink(link)
        if (target / "trainer_state.json").exists():
            return target
    steps = sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir()
                   if (m := CKPT_RE.match(p.name)) and (p / "trainer_state.json").exists())
    return steps[-1][1] if steps else None


def save_checkpoint(ckpt_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer,
                    loss: float, keep: int) -> float:
    started = time.perf_counter()
    tmp = ckpt_dir / f"tmp-checkpoint-{step}"
    final = ckpt_dir / f"checkpoint-{step}"
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an earlier crash: never complete
    tmp.mkdir(parents=True)
    torch.save(model.state_dict(), tmp / "model.pt")
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state()}, tmp / "rng_state.pth")
    # written last: its presence marks a complete checkpoint
    (tmp / "trainer_state.json").write_text(json.dumps({"global_step": step, "loss": loss}))
    os.replace(tmp, final)  # the directory appears under its final name only when complete
    new_link = ckpt_dir / "latest.tmp"
    if new_link.is_symlink():
        new_link.unlink()
    new_link.symlink_to(final.name)
    os.replace(new_link, ckpt_dir / "latest")
    # retention: keep the newest `keep` checkpoints
    old = sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := CKPT_RE.match(p.name)))
    for _, path in old[:-keep]:
        shutil.rmtree(path)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt-dir", type=Path, required=True,
                    help="directory on the mount, e.g. /mnt/ckpt/run1")
    ap.add_argument("--steps", type=int, default=200, help="train until this global step")
    ap.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    ap.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    ap.add_argument("--width", type=int, default=1024, help="hidden size (1024: ~4 MiB model)")
    ap.add_argument("--no-flush", action="store_true", help="skip `lakefs-mount flush` at the end")
    ap.add_argument("--crash-at", type=int, help="exit abruptly at this step (to try resuming)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = make_model(args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    step = 0
    resume = latest_checkpoint(args.ckpt_dir)
    if resume is not None:
        model.load_state_dict(torch.load(resume / "model.pt", weights_only=True))
        opt.load_state_dict(torch.load(resume / "optimizer.pt", weights_only=True))
        torch.set_rng_state(torch.load(resume / "rng_state.pth", weights_only=True)["torch"])
        step = json.loads((resume / "trainer_state.json").read_text())["global_step"]
        print(f"resumed from {resume} at step {step}", flush=True)

    loss = float("nan")
    while step < args.steps:
        x = torch.randn(32, 64)
        y = x.sum(dim=1, keepdim=True).tanh()
        loss_t = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss_t.backward()
        opt.step()
        step += 1
        loss = loss_t.item()
        if args.crash_at is not None and step == args.crash_at:
            print(f"crashing at step {step}", flush=True)
            os._exit(3)
        if step % args.every == 0:
            blocked = save_checkpoint(args.ckpt_dir, step, model, opt, loss, args.keep)
            print(f"step {step} loss {loss:.4f} checkpoint-{step} saved "
                  f"(training blocked {blocked * 1000:.0f} ms)", flush=True)

    if not args.no_flush:
        mountpoint = find_mountpoint(args.ckpt_dir)
        started = time.perf_counter()
        cli = shutil.which("lakefs-mount") or str(Path(sys.executable).parent / "lakefs-mount")
        proc = subprocess.run([cli, "flush", str(mountpoint)])
        if proc.returncode != 0:
            print(f"lakefs-mount flush {mountpoint} failed ({proc.returncode}): the last "
                  "checkpoints may not be in S3 yet", file=sys.stderr)
            return proc.returncode
        print(f"all checkpoints durable in S3 (flush took "
              f"{time.perf_counter() - started:.1f} s)", flush=True)
    print(f"done at step {step}, loss {loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
