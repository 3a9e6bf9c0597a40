"""The cost model: seconds for one block op or one transfer on a device profile.

An op costs its roofline time, the larger of FLOPs over peak FLOP/s and bytes over HBM bandwidth,
plus a kernel launch. A contraction whose join is a (scaled) product of two or more operands runs
on matrix units (`matmul_flops`, 2 FLOPs per multiply-add); everything else (elementwise joins,
max/min aggregation, fills, gathers, copies) on vector units, one FLOP per operand per element of
the join space. Bytes are every operand read once and the output written once (read and written
when accumulating). A transfer costs its bytes over the link bandwidth plus the copy latency; a
read from disk its bytes over the disk's read bandwidth plus its latency. A guarded op (a
mixture-of-experts task run only where its expert is chosen) costs its expected share of its
op's time: the prediction of a pass that routes is an expectation. A packed (quantized)
operand moves and is held as its packed bytes, and costs a dequantization kernel before the op
(`apply_seconds`), but for a gather's table, read as it lies.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from einpage.ir import scalar, stored
from einpage.ir.ops import BlockOp, CopyOp, EinsumOp, FillOp, GatherOp, unguarded
from einpage.predict.devices import DeviceProfile
from einpage.predict.hosts import HostProfile

#: A host write of at least this many bytes is cut into a range of rows per core: the host
#: pool's threshold (`runtime.hostpool.MIN_POOLED_BYTES`, which predict may not import)
POOLED_BYTES = 1 << 20


def op_work(op: BlockOp, read_shapes: Sequence[Sequence[int]], read_bytes: int,
            write_shape: Sequence[int], write_bytes: int, write_dtype: str,
            accumulate: bool) -> tuple[float, float, bool, str]:
    """(FLOPs, HBM bytes, on matrix units, dtype) of one block op."""
    moved = read_bytes + write_bytes * (2 if accumulate else 1)
    if isinstance(op, EinsumOp):
        sizes = op.spec.sizes(read_shapes)
        space = math.prod(int(v) for v in sizes.values())
        k = len(op.spec.inputs)
        product = scalar.scaled_product_factor(op.join, k) is not None
        matmul = product and k >= 2 and op.agg in (None, "sum") and bool(op.spec.contracted)
        flops = 2.0 * space * (k - 1) if matmul else float(space) * max(1, k)
        return flops, float(moved), matmul, op.dtype.value
    if isinstance(op, CopyOp):
        return 0.0, float(2 * write_bytes), False, write_dtype
    if isinstance(op, GatherOp):
        return 0.0, float(moved + write_bytes), False, write_dtype
    assert isinstance(op, FillOp)
    return float(math.prod(write_shape)), float(write_bytes), False, write_dtype


def op_seconds(profile: DeviceProfile, op: BlockOp, read_shapes, read_bytes: int,
               write_shape, write_bytes: int, write_dtype: str, accumulate: bool) -> float:
    flops, moved, matmul, dtype = op_work(op, read_shapes, read_bytes, write_shape, write_bytes,
                                          write_dtype, accumulate)
    return (max(flops / profile.flops(dtype, matmul), moved / profile.hbm_bandwidth)
            + profile.launch_overhead)


def apply_seconds(profile: DeviceProfile, op: BlockOp, reads: Sequence, write,
                  accumulate: bool) -> float:
    """`op_seconds` of an apply (or task) over tensor records (`.shape`, `.dtype`, `.bytes`,
    `.storage`): a packed (quantized) read is first dequantized into workspace by a kernel of its
    own (reading the packed bytes, writing the logical ones), and the op reads the logical
    ones; but a gather reads a packed table as it lies, dequantizing only what it picks (its
    kernel does both). A guarded op costs its op at its expected share (`GuardedOp.share`) and
    a launch where skipped."""
    op, guard = unguarded(op)
    if guard is not None:
        return (guard.share * apply_seconds(profile, op, reads[:-1], write, accumulate)
                + (1 - guard.share) * profile.launch_overhead)
    def fused(k: int, r) -> bool:
        return isinstance(op, GatherOp) and k == 0 and r.storage is not None

    unpack = sum((r.bytes + logical_bytes(r)) / profile.hbm_bandwidth + profile.launch_overhead
                 for k, r in enumerate(reads) if r.storage is not None and not fused(k, r))
    read = sum(r.bytes if fused(k, r) else logical_bytes(r) for k, r in enumerate(reads))
    return unpack + op_seconds(profile, op, [r.shape for r in reads], read, write.shape,
                               write.bytes, write.dtype.value, accumulate)


def host_apply_seconds(host: HostProfile, op: BlockOp, reads: Sequence, write,
                       accumulate: bool) -> float:
    """Seconds of an apply placed on the host (`einpage.predict.hosts`), as einpage runs it: a
    contraction the compiled kernels take (`kernels_seconds`) through them; any other
    contraction over unpacked operands cut into a chunk per core (the BLAS rate, the memory
    bandwidth of every core, and each core converting its share of the f16/bf16 operands to
    float32 with NumPy), a gather by the rows it picks (`gather_seconds`), anything else on one
    core (NumPy's ufuncs; packed operands dequantized
    first); plus the apply's dispatch. A guarded op: its op at its expected share, a dispatch
    where skipped."""
    op, guard = unguarded(op)
    if guard is not None:
        return (guard.share * host_apply_seconds(host, op, reads[:-1], write, accumulate)
                + (1 - guard.share) * host.apply_overhead)
    if isinstance(op, GatherOp):
        return gather_seconds(host, reads, write, accumulate) + host.apply_overhead
    through = kernels_seconds(host, op, reads) if host.kernels else None
    if through is not None:
        return through + host.apply_overhead
    narrow = [r for r in reads if r.storage is None and r.dtype.itemsize < 4]
    packed = [r for r in reads if r.storage is not None]
    converted = sum(math.prod(r.shape) for r in narrow)
    unpack = sum(math.prod(r.shape) for r in packed)
    read = sum(r.bytes for r in reads)
    flops, moved, matmul, _ = op_work(op, [r.shape for r in reads], read, write.shape,
                                      write.bytes, write.dtype.value, accumulate)
    if isinstance(op, EinsumOp) and not packed:
        cores = host.cores
        busy = max(flops / (host.matmul_flops if matmul else host.vector_flops * cores),
                   moved / host.memory_bandwidth, converted / (host.convert_rate * cores))
    else:
        busy = (max(flops / host.vector_flops, moved / host.core_bandwidth)
                + converted / host.convert_rate + unpack / host.dequant_rate)
    return busy + host.apply_overhead


def kernels_seconds(host: HostProfile, op: BlockOp, reads: Sequence) -> float | None:
    """Seconds of a contraction through the compiled kernels (`einpage.runtime.storedmm`), or
    None where they do not take it (`einpage.ir.stored.layout`). With few rows on the other side
    (`GEMV_ROWS`), every core decodes its share of the stored operand's elements at
    `stored_rate` / `packed_rate`, each further row costing an eighth more (measured: four rows
    run at 0.6-0.8 of one row's rate per element), unless the memory bandwidth is slower at the
    bytes read; with more rows one core decodes the operand in tiles while the BLAS multiplies
    them (one after the other)."""
    if not isinstance(op, EinsumOp):
        return None
    dtypes = tuple(np.dtype(np.uint8) if r.storage is not None else r.dtype.numpy for r in reads)
    lay = stored.layout(op, tuple(tuple(r.shape) for r in reads), dtypes,
                        tuple(r.storage for r in reads), tuple(r.dtype.numpy for r in reads))
    if lay is None:
        return None
    w = reads[lay.w]
    elements = math.prod(w.shape)
    rate = host.packed_rate if w.storage is not None else host.stored_rate
    if lay.rows <= stored.GEMV_ROWS:
        decode = elements / rate * (1 + (lay.rows - 1) / 8) / host.cores
        return max(decode, sum(r.bytes for r in reads) / host.memory_bandwidth)
    flops = 2.0 * elements * lay.rows
    return elements / rate + flops / host.matmul_flops


def gather_seconds(host: HostProfile, reads: Sequence, write, accumulate: bool) -> float:
    """A gather of rows on the host's CPU (`runtime.blockops`, NumPy). Over a table block cut
    by rows it clears its block (the first block's task only) and writes the rows of the ids
    its rows hold, adding where it accumulates: of B ids, each picks B times the block's share
    of the table's rows (by expectation; a packed table's rows dequantized at `dequant_rate`);
    the ids are read three times (offset, mask, pick). A write of POOLED_BYTES or more is
    cut into a range of rows per core (`hostpool.pooled_rows`): the memory's bandwidth, every
    core's dequantizing."""
    table, ids = reads[0], reads[1]
    src = getattr(table, "source", None)
    full = src.full_shape[0] if src is not None and src.full_shape else table.shape[0]
    share = table.shape[0] / full if full else 1.0
    rows = logical_bytes(write)
    cores = host.cores if write.bytes >= POOLED_BYTES else 1
    bandwidth = host.memory_bandwidth if cores > 1 else host.core_bandwidth
    cleared = 0 if accumulate or share >= 1 else rows
    unpack = (share * math.prod(write.shape) / (host.dequant_rate * cores)
              if table.storage is not None else 0.0)
    moved = cleared + share * rows * (3 if accumulate else 2) + 3 * ids.bytes
    return unpack + moved / bandwidth


def logical_bytes(record) -> int:
    """The bytes of a tensor record in its logical dtype (packed or not)."""
    return math.prod(record.shape) * record.dtype.itemsize


def h2d_seconds(profile: DeviceProfile, nbytes: int) -> float:
    return nbytes / profile.h2d_bandwidth + profile.copy_latency


def d2h_seconds(profile: DeviceProfile, nbytes: int) -> float:
    return nbytes / profile.d2h_bandwidth + profile.copy_latency


def peer_seconds(profile: DeviceProfile, nbytes: int, in_group: bool = False) -> float:
    """A send to a peer device: its bytes over the peer link (the group's, `in_group`: to a
    device of the sender's own tensor-parallel group of a pipeline of them) plus the copy
    latency."""
    return nbytes / (profile.group_rate if in_group else profile.peer_rate) + profile.copy_latency


def disk_seconds(profile: DeviceProfile, nbytes: int) -> float:
    return nbytes / profile.disk_bandwidth + profile.disk_latency


def task_seconds(profile: DeviceProfile, tg, on_host: frozenset[int] = frozenset(),
                 on_device: Sequence[float] | None = None) -> list[float]:
    """Predicted compute seconds of every task of a `TaskGraph`, by task id (those `on_host`, and
    the partition's own `host_tasks`, priced on the profile's host; `on_device`: every task's
    seconds on the device, known already: only the host's are priced)."""
    blocks = tg.blocks
    on_host = on_host | getattr(tg, "host_tasks", frozenset())  # (the partition's: gathers)
    known: dict = {}  # the tasks of one op over blocks of one shape cost the same: priced once

    def price(t, where=profile.host, how=host_apply_seconds) -> float:
        reads, write = [blocks[b] for b in t.reads], blocks[t.write]
        key = (how, t.op, t.accumulate, write.shape, write.dtype, write.bytes,
               *((r.shape, r.dtype, r.bytes, r.storage) for r in reads))
        if key not in known:
            known[key] = how(where, t.op, reads, write, t.accumulate)
        return known[key]

    if on_device is not None:
        if len(on_device) != len(tg.tasks):
            raise ValueError(f"{len(on_device)} device seconds for {len(tg.tasks)} tasks")
        return [price(tg.tasks[tid]) if tid in on_host else s for tid, s in enumerate(on_device)]
    return [price(t) if t.id in on_host else price(t, profile, apply_seconds) for t in tg.tasks]
