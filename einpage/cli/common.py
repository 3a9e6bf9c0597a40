"""What the command groups share: token input, the logits report, device-profile flags, and
writing a text output."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from einpage.errors import InputError
from einpage.units import parse_rate


def tokens_from_args(args) -> np.ndarray:
    """`--tokens 1,2,3` (one row) or `--tokens-file ids.npy` (batch, length) as int64."""
    if args.tokens is not None:
        try:
            ids = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise InputError(f"--tokens {args.tokens!r}: expected comma-separated integers") from None
        if not ids:
            raise InputError("--tokens is empty")
        return np.asarray([ids], dtype=np.int64)
    path = Path(args.tokens_file)
    try:
        ids = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise InputError(f"{path}: no such token file") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a .npy array: {exc}") from None
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{path}: token ids must be an integer array of shape (batch, length), "
                         f"got {ids.dtype} {ids.shape}")
    return ids.astype(np.int64)


def report_logits(logits: np.ndarray, out_path: str | None) -> None:
    """Save float32 logits (batch, length, vocab) to `out_path`, or print each row's next token."""
    logits = logits.astype(np.float32)
    if out_path:
        np.save(out_path, logits)
        print(f"saved logits {logits.shape} to {out_path}")
    else:
        for row, token in enumerate(np.argmax(logits[:, -1, :], axis=-1)):
            print(f"row {row}: next token {int(token)}")


def add_device_args(p) -> None:
    p.add_argument("--device", help="device profile for the cost model (default h100-pcie; "
                                    "see einpage devices)")
    p.add_argument("--device-file", help="device profile as JSON (keys of einpage devices --json)")
    p.add_argument("--h2d-bandwidth", help="override host<->device bandwidth, e.g. 25GB/s")
    p.add_argument("--flops", help="override peak matmul FLOP/s, e.g. 500T")
    p.add_argument("--plot", help="write a timeline picture (PNG): device memory by role and "
                                  "the three streams over predicted time")


def profile_from_args(args, default: str | None = None):
    """The device profile the flags ask for: `--device` or `--device-file` (else `default`, else
    the cost model's default), then `--h2d-bandwidth` (both directions) and `--flops`."""
    from einpage.predict import DEFAULT_DEVICE, get_device, load_device_file, with_overrides
    if args.device_file and args.device:
        raise InputError("give --device or --device-file, not both")
    profile = (load_device_file(args.device_file) if args.device_file
               else get_device(args.device or default or DEFAULT_DEVICE))
    h2d, flops = getattr(args, "h2d_bandwidth", None), getattr(args, "flops", None)
    return with_overrides(
        profile,
        h2d_bandwidth=parse_rate(h2d, "--h2d-bandwidth", "B") if h2d is not None else None,
        flops=parse_rate(flops, "--flops", "FLOPS") if flops is not None else None)


def write_text(path: str, text: str) -> None:
    """Write `text` to a temporary file beside `path` and rename it into place: a failed write
    (a full disk, no permission) leaves no half-written file and ends with one line."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
