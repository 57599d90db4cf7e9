"""CUDA graphs of the decode forward: one per padded batch size, replayed instead of launching
the step's ~30 kernels per layer one by one from Python.

A decode step (every sequence computes one token) has the same kernels and shapes for a given
batch size, so its forward is captured once per size in ``batch_sizes()`` and replayed on
static input buffers: a step of ``n`` sequences runs the smallest captured size ``>= n``, its
extra rows padded (slot -1: nothing is written to the cache; context length 1: they read one
cache position and their output is dropped). Prefill and mixed steps, and decode batches above
the largest size, run eagerly. The logits and the sampler run eagerly on the real rows.

Everything a captured kernel reads must live at a fixed address: the model's weights, the KV
cache's layer tensors (allocated once, swapped in place) and the buffers here. Host values that
size a launch are fixed per graph: ``max_query_len`` is 1 and the Triton attention's context
split depends on the batch size alone.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

import structlog
import torch

from executor_svc.attention import AttentionMetadata
from executor_svc.config import envs

if TYPE_CHECKING:
    from executor_svc.runner.batch import BatchInputs

log = structlog.get_logger(__name__)


def batch_sizes(max_batch: int) -> list[int]:
    """The captured sizes: 1, 2, 4, every multiple of 8 up to 256, then of 16: a step pads at
    most 7 rows (15 above 256), and capture stays within seconds at 1024."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += list(range(8, min(max_batch, 256) + 1, 8))
    sizes += list(range(272, max_batch + 1, 16))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """The captured decode forwards of one model and KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        max_batch: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.sizes = batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.max_blocks_per_seq = max_blocks_per_seq
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_blocks_per_seq,  # not read by the kernels
            num_decode_seqs=size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(
            self.input_ids[:size], self.positions[:size], self.kv_layers, self._metadata(size)
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones then reuse its memory pool)."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                # Eager runs first: Triton compiles and cuBLAS picks its kernels outside the
                # capture, which may not allocate workspaces or synchronize.
                self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._forward(size)
                self._graphs[size] = (graph, out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info(
            "cuda_graphs.captured",
            sizes=len(self.sizes),
            max_batch=self.max_batch,
            seconds=round(time.perf_counter() - t0, 2),
        )

    def can_run(self, batch: BatchInputs) -> bool:
        md = batch.attn_metadata
        return (
            md.max_query_len == 1
            and md.num_seqs <= self.max_batch
            and md.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def run(self, batch: BatchInputs) -> torch.Tensor:
        """The decode forward of ``batch`` (``can_run``) from the smallest graph that holds it:
        hidden states [num_seqs, hidden] (a view of the graph's output: read it before the
        next replay)."""
        md = batch.attn_metadata
        n = md.num_seqs
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = md.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.seq_lens[:n].copy_(md.seq_lens)
        # Columns past `width` keep older block ids: the kernel reads a row's table only up
        # to its context length.
        self.block_tables[:n, :width].copy_(md.block_tables)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        graph, out = self._graphs[size]
        graph.replay()
        return out[:n]


@torch.inference_mode()
def warm_up_prefill(
    model: torch.nn.Module,
    kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device,
    max_model_len: int,
    block_size: int,
) -> None:
    """One small forward per power-of-two query length up to 256: Triton compiles a prefill
    attention variant per tile height, which would otherwise stall a served step for about a
    second each (seen on an H100: 17 % of the executor's time in a 1000-prompt run)."""
    q = 2
    while q <= min(256, max_model_len):
        md = AttentionMetadata(
            slot_mapping=torch.full((q,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros(1, -(-q // block_size), dtype=torch.int32, device=device),
            seq_lens=torch.tensor([q], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, q], dtype=torch.int32, device=device),
            max_query_len=q,
            max_seq_len=q,
        )
        ids = torch.zeros(q, dtype=torch.long, device=device)
        model(ids, torch.arange(q, device=device), kv_layers, md)
        q *= 2
    torch.cuda.synchronize(device)


def build_decode_graphs(
    model: torch.nn.Module,
    kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device,
    max_model_len: int,
    block_size: int,
    num_device_blocks: int,
) -> DecodeGraphs | None:
    """Captured decode graphs for a CUDA runner, or None (CPU, ``--enforce-eager``, or a
    capture that failed: the runner then stays eager and says why). On CUDA the prefill
    attention variants are compiled first (``warm_up_prefill``), graphs or not."""
    if device.type != "cuda":
        return None
    warm_up_prefill(
        model, kv_layers, device=device, max_model_len=max_model_len, block_size=block_size
    )
    if envs.enforce_eager():
        return None
    max_blocks = -(-max_model_len // block_size)
    # No batch larger than the cache can hold sequences of one block each.
    max_batch = max(1, min(envs.max_graph_batch(), num_device_blocks))
    graphs = DecodeGraphs(
        model, kv_layers, max_batch=max_batch, max_blocks_per_seq=max_blocks, device=device
    )
    try:
        graphs.capture()
    except Exception as e:  # noqa: BLE001 - eager steps still work; say why graphs do not
        log.warning("cuda_graphs.disabled", error=f"{type(e).__name__}: {e}"[:500])
        torch.cuda.synchronize()
        return None
    return graphs
