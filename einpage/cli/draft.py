"""`generate --draft`: speculative decoding's flags, the draft (prompt lookup or a draft model)
and its share of the device budget, searched by simulated step time as `compile --draft` does."""
from __future__ import annotations

from pathlib import Path

from einpage.cli.common import host_budget, host_options
from einpage.errors import InputError
from einpage.ir.dtypes import as_dtype
from einpage.units import parse_size


def draft_tokens(args) -> int | None:
    """`--draft-tokens K` (default 4) where there is a --draft; None without one."""
    if args.draft is None:
        for flag, value in (("--draft-tokens", args.draft_tokens),
                            ("--draft-gpu-mem", args.draft_gpu_mem)):
            if value is not None:
                raise InputError(f"{flag} is an option of --draft: give --draft ngram or a "
                                 "draft checkpoint")
        return None
    most = min(64, args.kv_granule)
    if args.draft_tokens == "auto":
        from einpage.models.speculative import AUTO_TOKENS
        return min(max(AUTO_TOKENS), most)
    try:
        k = 4 if args.draft_tokens is None else int(args.draft_tokens)
    except ValueError:
        raise InputError(f"--draft-tokens takes a count or auto, got {args.draft_tokens!r}") \
            from None
    if not 1 <= k <= most:
        raise InputError(f"--draft-tokens must be between 1 and {most} (64, and at most "
                         f"--kv-granule), got {k}")
    return k


def draft_from_args(args, cfg, k: int | None, given):
    """(the draft: an NgramDraft, or (config, weights) of a draft model; the device bytes the
    draft takes of --gpu-mem, 0 for prompt lookup or without a budget)."""
    if args.draft is None:
        return None, 0
    if args.draft == "ngram":
        if args.draft_gpu_mem is not None:
            raise InputError("--draft-gpu-mem is the budget of a draft model; ngram has none")
        from einpage.models.speculative import NgramDraft
        return NgramDraft(k), 0
    path = Path(args.draft)
    if not (path.is_dir() or path.is_file()):
        raise InputError(f"--draft takes ngram or a draft checkpoint (a directory or a GGUF "
                         f"file); {args.draft!r} is neither")
    from einpage.models import resolve
    dcfg, dweights = resolve(args.draft, dtype=as_dtype(args.dtype) if args.dtype else None)
    from einpage.models.speculative import check_vocabulary, draft_bytes
    check_vocabulary(dcfg, cfg, args.draft, args.model)
    budget = 0
    devices = max(1, getattr(args, "devices", 1))
    if args.gpu_mem and args.draft_gpu_mem is None and args.backend != "reference":
        budget = _searched_split(args, cfg, dcfg, k, given, devices)
    elif args.gpu_mem or args.arena:
        budget = (parse_size(args.draft_gpu_mem, "--draft-gpu-mem") if args.draft_gpu_mem
                  else draft_bytes(dcfg, given.tokens.shape[0],
                                   int(given.lengths.max()) + args.max_new_tokens + k + 1))
    elif args.draft_gpu_mem is not None:
        raise InputError("--draft-gpu-mem splits a --gpu-mem budget: give --gpu-mem too")
    return (dcfg, dweights), budget


def _searched_split(args, cfg, dcfg, k: int, given, devices: int = 1) -> int:
    """The draft's share of --gpu-mem by simulated step time (`forecast.search_draft_split`, as
    `compile --draft` chooses it), at the last KV bucket of the generation, an acceptance of
    0.7 and the proposals per pass it will run; with --devices N, each device's share, every
    step planned for the devices as the generation will run it."""
    from einpage.cli.execute import _profile
    from einpage.compiler import CompileOptions
    from einpage.forecast import search_draft_split
    from einpage.models.kvstore import capacity_for
    from einpage.models.speculative import AUTO_TOKENS
    ks = tuple(n for n in AUTO_TOKENS if n <= k) if args.draft_tokens == "auto" else (k,)
    if devices > 1:  # the processes of mpiexec share this machine, as the ranks' runner
        from einpage.cli.ranks import ranks_host_budget  # counts it
        host_bytes = ranks_host_budget(args)
    else:
        host_bytes, _ = host_budget(args)
    options = CompileOptions(device_bytes=parse_size(args.gpu_mem, "--gpu-mem"),
                             policy=args.policy or "reuse-distance", device=_profile(args),
                             host_bytes=host_bytes, **host_options(args))
    capacity = min(capacity_for(int(given.lengths.max()) + args.max_new_tokens,
                                args.kv_granule), int(given.lengths.max()) + args.max_new_tokens)
    f, _ = search_draft_split(cfg, given.tokens.shape[0], capacity, 0.7, ks, options,
                              {"past": int(given.lengths.max())}, dcfg, devices,
                              getattr(args, "parallel", "pipeline"))
    return f.draft_bytes
