"""What the command groups share: token and text input, the logits report, device-profile
flags, and writing a text output."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from einpage.errors import InputError
from einpage.units import format_size, parse_rate

if TYPE_CHECKING:
    from einpage.models.text import TextCodec


def tokens_from_args(args) -> np.ndarray:
    """`--tokens 1,2,3` (one row) or `--tokens-file ids.npy` (batch, length) as int64."""
    if args.tokens is not None:
        try:
            ids = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise InputError(f"--tokens {args.tokens!r}: expected comma-separated integers") from None
        if not ids:
            raise InputError("--tokens is empty")
        big = [t for t in ids if not _INT64_MIN <= t <= _INT64_MAX]
        if big:
            raise InputError(f"--tokens: token id {big[0]} is out of range (ids are 64-bit)")
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
    if ids.size and ids.dtype.kind == "u" and int(ids.max()) > _INT64_MAX:
        raise InputError(f"{path}: token id {int(ids.max())} is out of range (ids are 64-bit)")
    return ids.astype(np.int64)


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class ModelInput:
    """What a run starts from: token ids (batch, length) int64, rows padded on the right to the
    longest; each row's real length; the checkpoint's tokenizer where the input is text or the
    caller asked for it (else None); and whether the input was text."""
    tokens: np.ndarray
    lengths: np.ndarray
    codec: TextCodec | None = None
    text: bool = False


def prompts_from_args(args) -> list[str] | None:
    """`--prompt TEXT` (repeatable: a batch) or `--prompt-file F` (one prompt per line), else
    None (token input). Empty prompts, an unreadable file and an empty file are InputErrors."""
    if getattr(args, "prompt", None) is not None:
        for k, text in enumerate(args.prompt):
            if text == "":
                which = f"--prompt {k + 1}" if len(args.prompt) > 1 else "--prompt"
                raise InputError(f"{which} is empty")
        return list(args.prompt)
    if getattr(args, "prompt_file", None) is None:
        return None
    path = Path(args.prompt_file)
    try:
        raw = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise InputError(f"{path}: no such prompt file") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise InputError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None
    if raw.endswith("\n"):
        raw = raw[:-1]
    if raw.strip("\r\n") == "":
        raise InputError(f"{path}: the prompt file is empty (one prompt per line)")
    lines = [line[:-1] if line.endswith("\r") else line for line in raw.split("\n")]
    for k, line in enumerate(lines):
        if line == "":
            raise InputError(f"{path}: line {k + 1} is empty (one prompt per line)")
    return lines


def input_from_args(args, tokenizer_dir: str | Path | None, *, want_codec: bool = False
                    ) -> ModelInput:
    """The run's input from `--prompt`/`--prompt-file` (tokenized with `tokenizer_dir`'s
    tokenizer: required) or `--tokens`/`--tokens-file`. With `want_codec`, token input gets
    the tokenizer too where `tokenizer_dir` has one."""
    from einpage.models.text import TextCodec, has_tokenizer
    texts = prompts_from_args(args)
    if texts is None:
        tokens = tokens_from_args(args)
        codec = (TextCodec.from_checkpoint(tokenizer_dir) if want_codec and tokenizer_dir
                 is not None and has_tokenizer(tokenizer_dir) else None)
        return ModelInput(tokens, np.full(tokens.shape[0], tokens.shape[1], np.int64), codec)
    if tokenizer_dir is None:
        raise InputError("--prompt and --prompt-file need a checkpoint directory with a "
                         "tokenizer.json; a preset has none (give --tokens or --tokens-file)")
    from einpage.models.generation import pad_rows
    codec = TextCodec.from_checkpoint(tokenizer_dir)
    rows = [codec.encode(text) for text in texts]
    for k, row in enumerate(rows):
        if not row:
            raise InputError(f"prompt {k + 1} ({texts[k][:40]!r}) encodes to no tokens")
    tokens, lengths = pad_rows(rows)
    return ModelInput(tokens, lengths, codec, text=True)


def check_context(cfg, longest: int, new_tokens: int = 0) -> None:
    """Refuse a run whose positions pass the model's context (`max_position_embeddings`): a
    prompt of `longest` tokens and `new_tokens` generated ones use `longest + new_tokens - 1`
    positions (the last new token is never run)."""
    context = getattr(cfg, "context", None)
    need = longest + max(new_tokens - 1, 0)
    if context is not None and need > context:
        extra = f" and {new_tokens} new tokens" if new_tokens else ""
        raise InputError(f"a prompt of {longest} tokens{extra} needs {need} positions; the "
                         f"model's context is {context} (max_position_embeddings)")


def check_finite(logits: np.ndarray, lengths: np.ndarray) -> None:
    """Refuse logits with NaN or inf at a row's real positions (pads are not looked at): a
    next token or saved logits from them would mean nothing."""
    real = np.arange(logits.shape[1])[None, :] < np.asarray(lengths)[:, None]
    bad = real & ~np.isfinite(logits).all(axis=-1)
    if bad.any():
        row, pos = (int(v) for v in np.argwhere(bad)[0])
        raise InputError(f"the model produced non-finite logits (NaN or inf; first at row {row}, "
                         f"position {pos}): the weights hold NaN or inf, or the computation "
                         "dtype overflows (try --dtype f32)")


def report_logits(logits: np.ndarray, out_path: str | None, lengths: np.ndarray | None = None,
                  codec=None) -> None:
    """Save float32 logits (batch, length, vocab) to `out_path` (rows padded on the right: a
    row's positions from its length on are its pads), or print each row's next token (from its
    last real position), with its text where `codec` is given."""
    logits = logits.astype(np.float32)
    lengths = (np.full(logits.shape[0], logits.shape[1], np.int64) if lengths is None
               else np.asarray(lengths))
    check_finite(logits, lengths)
    if out_path:
        from einpage.errors import OutputError
        from einpage.outputs import save_npy
        try:
            save_npy(out_path, logits)  # exactly `out_path`: no .npy is added
        except OutputError:  # the run's result is not lost with its file: print it, then fail
            report_logits(logits, None, lengths, codec)
            raise
        ragged = (lengths != logits.shape[1]).any()
        note = (f" (rows padded on the right; row lengths {','.join(map(str, lengths.tolist()))})"
                if ragged else "")
        print(f"saved logits {logits.shape} to {out_path}{note}")
        return
    from einpage.models.generation import last_logits
    last = last_logits(logits, lengths)
    for row, token in enumerate(np.argmax(last, axis=-1)):
        text = f" {json.dumps(codec.decode([int(token)]), ensure_ascii=False)}" if codec else ""
        print(f"row {row}: next token {int(token)}{text}")


#: `--policy`'s help: the eviction policies (`einpage.compiler.POLICIES`; a test keeps the two
#: in step, and an unknown name is refused with the list)
POLICY_HELP = ("eviction policy: reuse-distance (default: evict what is needed farthest ahead), "
               "lru, layerwise (whole-layer weight streaming), none (no offload)")


def check_budget(budget: int, profile, force: bool) -> str | None:
    """A budget above `profile`'s memory is an `InputError` naming both; with `force` it is
    allowed, and the warning to show is returned (else None)."""
    if budget <= profile.memory_bytes:
        return None
    message = (f"--gpu-mem {format_size(budget)} is more than the "
               f"{format_size(profile.memory_bytes)} of the device {profile.name}")
    if not force:
        raise InputError(f"{message}: pick a --device that has it, or add --force")
    return message


#: `--cpu-mem`'s default leaves this share of the available memory, and at least HOST_MARGIN_MIN
#: bytes, to the rest of the machine (the Python process itself, the page cache, other programs)
HOST_MARGIN_SHARE = 0.10
HOST_MARGIN_MIN = 2 * 10**9


def add_quantize_arg(p) -> None:
    from einpage.ir.storage import FORMATS, WRITABLE
    p.add_argument("--quantize", choices=WRITABLE,
                   help="keep every matrix weight in a block format, quantized block by block "
                        "as the plan reads it (rounded as GGUF's quantizer rounds): " +
                        "; ".join(f"{n} {FORMATS[n].bits:g} bits ({FORMATS[n].layout})"
                                  for n in WRITABLE))
    p.add_argument("--kv-dtype", choices=("q8_0",),
                   help="keep the KV store in a block format: q8_0, one f16 scale per 32 values "
                        "of a head's row (8.5 bits; llama.cpp's -ctk q8_0); default: the model "
                        "dtype")


def add_host_args(p) -> None:
    p.add_argument("--cpu-mem", help="host memory budget: weight blocks kept in (pinned) host "
                                     "memory, offloaded blocks, the KV store and the staging "
                                     "buffers of disk reads; weight blocks that do not fit are "
                                     "read from the checkpoint files every pass. 64GB, 64GiB, "
                                     "... or 'unlimited' (default: $EINPAGE_CPU_MEM if set, "
                                     "else this machine's available memory less 10%% and at "
                                     "least 2 GB)")


def available_host_memory() -> int | None:
    """This machine's available memory (Linux `MemAvailable`, else free pages), or None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_options(args) -> dict:
    """The compile options `--host-compute` sets: `auto` weighs applies placed on the host and
    gathers a pass's embedding rows there where it does not fit (`compiler.host_gather`);
    `off` runs every task on the device."""
    auto = args.host_compute == "auto"
    return {"host_compute": auto, "host_gather": auto}


def host_budget(args) -> tuple[int | None, str]:
    """`--cpu-mem` in bytes (None: unlimited) and, in words, where the figure came from."""
    from einpage.units import parse_size
    text = getattr(args, "cpu_mem", None)
    source = "--cpu-mem"
    if text is None and os.environ.get("EINPAGE_CPU_MEM"):
        text, source = os.environ["EINPAGE_CPU_MEM"], "EINPAGE_CPU_MEM"
    if text is not None:
        if text.strip().lower() in ("unlimited", "none", "inf"):
            return None, f"unlimited ({source})"
        return parse_size(text, source), source
    available = available_host_memory()
    if available is None:
        return None, "unlimited (this machine's memory is unknown; set --cpu-mem)"
    margin = max(HOST_MARGIN_MIN, int(available * HOST_MARGIN_SHARE))
    budget = max(available - margin, 1)
    return budget, (f"this machine's available memory {format_size(available)} less "
                    f"{format_size(margin)}; set --cpu-mem for another host")


def add_device_args(p) -> None:
    p.add_argument("--device", help="device profile for the cost model (default h100-pcie; "
                                    "see einpage devices); with --device-file, the profile of "
                                    "that name in the file")
    p.add_argument("--device-file", help="device profile(s) as JSON: what einpage calibrate -o "
                                         "or einpage devices --json writes (pick one of several "
                                         "with --device)")
    p.add_argument("--host", help="host profile: what an apply placed on the host costs "
                                  "(default server-16c; see einpage devices)")
    p.add_argument("--host-file", help="host profile as JSON: what einpage calibrate --host-out "
                                       "writes")
    p.add_argument("--h2d-bandwidth", help="override host<->device bandwidth, e.g. 25GB/s")
    p.add_argument("--flops", help="override peak matmul FLOP/s, e.g. 500T")
    p.add_argument("--disk-bandwidth", help="read bandwidth of the drive the checkpoint lies "
                                            "on, e.g. 7GB/s (default: the profile's, 3 GB/s, "
                                            "a PCIe Gen3 NVMe drive; einpage calibrate --disk "
                                            "measures yours)")
    from einpage.cli.outputs import OutputPath
    p.add_argument("--plot", action=OutputPath,
                   help="write a timeline picture (PNG): device memory by role and the three "
                        "streams over predicted time")


def profile_from_args(args, default: str | None = None):
    """The device profile the flags ask for: `--device` or `--device-file` (with `--device`:
    the profile of that name in the file; else `default`, else the cost model's default), in the
    host of `--host` or `--host-file`, then `--h2d-bandwidth` (both directions) and `--flops`."""
    from dataclasses import replace

    from einpage.predict import DEFAULT_DEVICE, get_device, load_device_file, with_overrides
    from einpage.predict.hosts import get_host, load_host_file
    profile = (load_device_file(args.device_file, args.device) if args.device_file
               else get_device(args.device or default or DEFAULT_DEVICE))
    host_file, host = getattr(args, "host_file", None), getattr(args, "host", None)
    if host_file or host:
        profile = replace(profile, host=load_host_file(host_file) if host_file
                          else get_host(host))
    h2d, flops = getattr(args, "h2d_bandwidth", None), getattr(args, "flops", None)
    disk = getattr(args, "disk_bandwidth", None)
    return with_overrides(
        profile,
        h2d_bandwidth=parse_rate(h2d, "--h2d-bandwidth", "B") if h2d is not None else None,
        flops=parse_rate(flops, "--flops", "FLOPS") if flops is not None else None,
        disk_bandwidth=parse_rate(disk, "--disk-bandwidth", "B") if disk is not None else None)


def write_text(path: str, text: str) -> None:
    """Write `text` to a temporary file beside `path` and rename it into place: a failed write
    (a full disk, no permission) leaves no half-written file and ends with one line (an
    `OutputError`). See `einpage.outputs`."""
    from einpage.outputs import write_text as write
    write(path, text)


def load_plan(path: str, mg=None):
    """The one way the CLI reads a plan file: `MemGraph.load` (unless the plan read from it is
    given), then `validate` (memory and order, and that it computes the graph it carries). A
    plan without a graph (version 1) runs with a warning that says what could not be proven.
    Returns (plan, validation report)."""
    from einpage.ir import MemGraph, validate
    mg = MemGraph.load(path) if mg is None else mg
    report = validate(mg)
    if not report.proven:
        print(f"einpage: warning: {path} is a version 1 plan: it carries no graph, so its memory "
              "and order were checked but not that it computes its model; compile it again for a "
              "plan that proves it", file=sys.stderr)
    return mg, report


def add_parallel_arg(p) -> None:
    """`--parallel`: how `--devices N` spreads the model (`einpage.compiler.parallel`)."""
    p.add_argument("--parallel", choices=("pipeline", "tensor", "hybrid", "auto"),
                   default="pipeline",
                   help="with --devices: pipeline (consecutive layers per device; default), "
                        "tensor (every layer's heads and FFN columns split over the devices, "
                        "all-reduced), hybrid (a pipeline of tensor-parallel groups: 4 devices "
                        "as 2 stages of 2, the group size predicted fastest), or auto: the one "
                        "predicted fastest")
