"""Train a small 10-class model and save a checkpoint the way people do.

Single process (CPU, or cuda:0 when present):

    python -m training --mode single --model lenet --epochs 2 --out lenet.pt

DataParallel (wraps even on CPU; --save-style wrapped keeps the "module." keys):

    python -m training --mode dp --model mlp --epochs 2 --save-style wrapped --out dp_mlp.pt

DistributedDataParallel on one node, 2 processes (gloo on CPU, nccl with one GPU per process):

    torchrun --standalone --nproc-per-node 2 -m training --mode ddp --model lenet --epochs 2 --out ddp.pt

DDP across 2 nodes (run on each node; R is 0 on the master node, 1 on the other; rank 0 saves):

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank R --rdzv-backend c10d \\
        --rdzv-endpoint MASTER_HOST:29500 -m training --mode ddp --model lenet --out ddp.pt

FSDP2 (``fully_shard``; gloo on CPU, nccl with one GPU per process), saved as a sharded DCP directory:

    torchrun --standalone --nproc-per-node 2 -m training --mode fsdp --model lenet --save-format dcp --out fsdp.dcp

Any mode saves a DCP directory (``.metadata`` + one ``__<rank>_0.distcp`` per rank) with
``--save-format dcp``; DDP across 2 nodes this way needs --out on a filesystem both nodes see:

    torchrun --standalone --nproc-per-node 2 -m training --mode ddp --model lenet --save-format dcp --out ddp.dcp

Resume a full training checkpoint, a file or a DCP directory (runs --epochs more epochs; "epoch"
counts completed epochs). DCP reshards, so a directory saved by 2 DDP ranks resumes under FSDP or
in one process:

    python -m training --mode single --model lenet --epochs 1 --resume lenet.pt --out lenet_3.pt
    python -m training --mode single --model lenet --epochs 1 --resume ddp.dcp --out lenet_from_dcp.pt

The default save is a full training checkpoint that loads with ``torch.load(path, weights_only=True)``:
``{"model": state_dict, "optimizer": ..., "epoch": int, "config": {...}, "metrics": {"test_accuracy",
"train_loss"}}``; ``--weights-only`` saves the bare state_dict. ``--save-style wrapped`` saves the
DataParallel/DDP wrapper's state_dict (every key starts with ``module.``), ``unwrapped`` (default)
the inner model's (FSDP has no wrapper: plain keys either way). Under FSDP ``--save-format torch``
gathers the full state dict onto rank 0 (CPU tensors) and numbers the optimizer state like
``optimizer.state_dict()``, so the file loads into an unsharded model and Adam.

``--save-format dcp`` writes ``{"model", "optim", "extra": {"epoch", "config", "metrics"}}`` from
every rank into a temp directory beside --out that rank 0 renames into place once all have
written; it holds the model's own keys (``get_state_dict``), so it takes no ``--save-style wrapped``.
An existing --out file (torch) or DCP directory (dcp) is replaced; any other directory is refused.
Resuming a DCP directory unpickles its ``.metadata`` through an allowlist and its plain values with
``weights_only=True``.

Data: ``--data synthetic`` (default, generated offline from --seed) or ``--data mnist --data-dir DIR``
(torchvision's MNIST layout under DIR; nothing is downloaded).

Exit codes: 0 saved; 2 bad arguments, launch environment or missing dataset; 1 any other expected
failure (e.g. a --resume checkpoint that does not fit). Errors are one line on stderr, nothing is written.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from training import TrainingError
# Only torch-free modules here: a bad argument, launch environment, --out or missing dataset is
# reported before ``import torch`` (training.loop, imported in main), which costs seconds per process.
from training.options import (
    DATASETS,
    DEVICES,
    MODEL_NAMES,
    MODES,
    SAVE_FORMATS,
    SAVE_STYLES,
    RunConfig,
    check_dataset_present,
    check_output_writable,
    process_info,
    validate,
)

PROG = "training"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``training: error: ...``) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} — see python -m training --help\n")


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments; every default matches :class:`training.loop.RunConfig`."""
    defaults = RunConfig()
    parser = OneLineArgumentParser(
        prog=PROG,
        description="Train lenet/mlp/resnet18 (single, DataParallel, DDP or FSDP) and save a checkpoint.",
        epilog="Examples: python -m training --mode single --model lenet --out lenet.pt ; "
        "torchrun --standalone --nproc-per-node 2 -m training --mode ddp --out ddp.pt ; "
        "torchrun --standalone --nproc-per-node 2 -m training --mode fsdp --save-format dcp --out fsdp.dcp",
    )
    parser.add_argument(
        "--mode", choices=MODES, default=defaults.mode, help="single process, nn.DataParallel, or DDP / FSDP2 under torchrun"
    )
    parser.add_argument("--model", choices=MODEL_NAMES, default=defaults.model)
    parser.add_argument("--epochs", type=int, default=defaults.epochs, help="epochs to run (more after --resume)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="per process")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seeds the model init, data and shuffling")
    parser.add_argument(
        "--out", type=Path, required=True, help="checkpoint file, or directory for --save-format dcp (its parent must exist)"
    )
    parser.add_argument(
        "--save-style",
        choices=SAVE_STYLES,
        default=defaults.save_style,
        help="wrapped: the DP/DDP wrapper's state_dict ('module.' keys); unwrapped: the inner model's",
    )
    parser.add_argument(
        "--save-format",
        choices=SAVE_FORMATS,
        default=defaults.save_format,
        help="torch: one torch.save file from rank 0; dcp: a torch.distributed.checkpoint directory from every rank",
    )
    parser.add_argument("--weights-only", action="store_true", help="save the bare state_dict, not the training checkpoint")
    parser.add_argument(
        "--resume", type=Path, default=None, help="continue from a full training checkpoint (a torch file or a DCP directory)"
    )
    parser.add_argument(
        "--device", choices=DEVICES, default=defaults.device,
        help="auto: a GPU where torch sees one (DDP/FSDP: one per process, on nccl), else the CPU (gloo)")
    parser.add_argument("--data", choices=DATASETS, default=defaults.data)
    parser.add_argument("--data-dir", type=Path, default=None, help="where MNIST lies (torchvision layout)")
    parser.add_argument("--train-size", type=int, default=None, help="training samples (default 6000 synthetic / all MNIST)")
    parser.add_argument("--test-size", type=int, default=None, help="test samples (default 1000 synthetic / all MNIST)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, train, save; return the exit code (expected errors become one stderr line)."""
    args = build_parser().parse_args(argv)
    config = RunConfig(
        mode=args.mode,
        model=args.model,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        out=args.out,
        save_style=args.save_style,
        save_format=args.save_format,
        weights_only=args.weights_only,
        resume=args.resume,
        data=args.data,
        data_dir=args.data_dir,
        train_size=args.train_size,
        test_size=args.test_size,
        device=args.device,
    )
    try:
        # run() checks these again; here they come before torch is imported
        validate(config)
        if process_info(config.mode, os.environ).is_main:
            check_output_writable(config.out, config.save_format)
        check_dataset_present(config.data, config.data_dir)
        from training.loop import run

        run(config, log=lambda line: print(line, flush=True))
    except TrainingError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted — nothing was saved", file=sys.stderr)
        return 130
    return 0


def exit_worker(code: int) -> NoReturn:
    """End a torchrun worker now, skipping the C++ teardown of interpreter exit.

    After a distributed run is over (its checkpoint renamed into place after an fsync, its process
    group destroyed), torch's static destructors at interpreter exit sometimes abort the process
    (SIGABRT, "terminate called without an active exception", with no Python frame left), and
    torchrun reports the finished run as failed. Measured on 2 CPUs, a 2-process DDP run launched two at
    a time: 3 aborted of 37 launches; 0 of 60 since workers end here. Nothing is left to finalize, so
    the worker flushes its output and exits with its code, without that teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_code = main()
    if "LOCAL_RANK" in os.environ:  # a torchrun worker (set by the launcher, never by a user's shell)
        exit_worker(exit_code)
    sys.exit(exit_code)
