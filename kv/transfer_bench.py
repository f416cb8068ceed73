"""NIXL transfer micro-benchmark: WRITE and READ of KV-shaped block layouts next to a plain memcpy, in one run.

    python -m kv.transfer_bench [--backend UCX] [--layers 4] [--block-kib 16] [--repeats 7]

Two processes, as prefill and decode are: the target registers one region per layer and waits; the initiator WRITEs
into it and READs from it. Each size is moved twice: as contiguous blocks (adjacent blocks merge into one descriptor
per layer) and as fragmented blocks (every other block, one descriptor per block and layer), which is what a busy
engine's block table looks like. Agents are configured as the app's engines run them (no progress thread; the
initiator polls the transfer). memcpy of the same bytes in one process is the ceiling on this machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

from rich.console import Console
from rich.table import Table

SIZES = [64 << 10, 1 << 20, 16 << 20, 256 << 20]
TARGET_POLL_S = 0.001
TRANSFER_LIMIT_S = 60.0


def _agent(name: str, backend: str):
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[backend], capture_telemetry=True,
                                              sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))


def _kv_regions(layers: int, num_blocks: int, block_bytes: int):
    import torch

    return [torch.ones(num_blocks * block_bytes, dtype=torch.uint8) for _ in range(layers)]


def _target(conn, backend: str, layers: int, num_blocks: int, block_bytes: int) -> None:
    """Holds registered KV regions for the initiator to WRITE to and READ from, until told to stop."""
    agent = _agent("target", backend)
    regions = _kv_regions(layers, num_blocks, block_bytes)
    agent.register_memory(agent.get_reg_descs(regions))
    conn.send((agent.get_agent_metadata(), [r.data_ptr() for r in regions]))
    # Like an engine between steps, the target drives its agent's progress now and then: without a progress thread,
    # UCX completes large transfers only while both sides progress.
    while not conn.poll(TARGET_POLL_S):
        agent.get_new_notifs()


def _descs(bases: list[int], block_ids: list[int], block_bytes: int) -> list[tuple[int, int, int]]:
    """(address, length, device) per run of adjacent blocks, per layer."""
    descs = []
    for base in bases:
        start = prev = block_ids[0]
        for block in block_ids[1:] + [None]:
            if block is not None and block == prev + 1:
                prev = block
                continue
            descs.append((base + start * block_bytes, (prev - start + 1) * block_bytes, 0))
            if block is not None:
                start = prev = block
    return descs


def _timed_transfer(agent, op: str, local, remote) -> float:
    handle = agent.initialize_xfer(op, local, remote, "target")
    start = time.perf_counter()
    agent.transfer(handle)
    while (state := agent.check_xfer_state(handle)) == "PROC":
        if time.perf_counter() - start > TRANSFER_LIMIT_S:
            raise RuntimeError(f"{op} still in progress after {TRANSFER_LIMIT_S:.0f} s")
    elapsed = time.perf_counter() - start
    agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"{op} ended in state {state}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="UCX")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block-kib", type=int, default=16, help="bytes of one block in one layer, in KiB")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import torch

    block_bytes = args.block_kib << 10
    blocks_for = {size: max(1, size // (block_bytes * args.layers)) for size in SIZES}
    num_blocks = 2 * max(blocks_for.values())  # room for the fragmented layout (every other block)

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    target = ctx.Process(target=_target, args=(there, args.backend, args.layers, num_blocks, block_bytes))
    target.start()
    try:
        remote_meta, remote_bases = here.recv()
        agent = _agent("initiator", args.backend)
        regions = _kv_regions(args.layers, num_blocks, block_bytes)
        agent.register_memory(agent.get_reg_descs(regions))
        agent.add_remote_agent(remote_meta)
        local_bases = [r.data_ptr() for r in regions]

        table = Table(title=f"NIXL {args.backend}, {args.layers} layers x {args.block_kib} KiB blocks, "
                            f"median of {args.repeats}: GB/s (descriptors)")
        for column in ("bytes", "memcpy", "WRITE contiguous", "WRITE fragmented", "READ contiguous",
                       "READ fragmented", "best NIXL / memcpy"):
            table.add_column(column, justify="right")
        for size in SIZES:
            n = blocks_for[size]
            moved = n * block_bytes * args.layers
            src, dst = torch.ones(moved, dtype=torch.uint8), torch.empty(moved, dtype=torch.uint8)
            memcpy = statistics.median(_timed_copy(dst, src) for _ in range(args.repeats))
            cells, best = [], 0.0
            for op in ("WRITE", "READ"):
                for blocks in (list(range(n)), list(range(0, 2 * n, 2))):
                    local_descs = _descs(local_bases, blocks, block_bytes)
                    local = agent.get_xfer_descs(local_descs, "DRAM")
                    remote = agent.get_xfer_descs(_descs(remote_bases, blocks, block_bytes), "DRAM")
                    seconds = statistics.median(_timed_transfer(agent, op, local, remote)
                                                for _ in range(args.repeats))
                    best = max(best, moved / seconds)
                    cells.append(f"{moved / seconds / 1e9:.2f} ({len(local_descs)})")
            table.add_row(_human(moved), f"{moved / memcpy / 1e9:.2f}", *cells, f"{best * memcpy / moved:.2f}x")
        Console(width=120).print(table)
    finally:
        here.send("stop")
        target.join(timeout=30)


def _timed_copy(dst, src) -> float:
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


def _human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


if __name__ == "__main__":
    main()
