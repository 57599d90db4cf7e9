"""ModelRunner: one engine step on the executor — cache operations, forward, logits, sampling.

Optional features (one folder each under ``features/``) plug in at the hooks of
``features/base.py``; the step iterates the ones a step uses and names none of them.

It knows nothing about gRPC or per-request state: the service hands it fully-described sequences
(``ScheduledSequence``) and the block lists of the step, and gets one ``SampleResult`` per
sequence that completed its scheduled tokens up to the end of what is known.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from executor_svc.attention import AttentionMetadata, get_attention_backend
from executor_svc.features.base import Feature, LoadContext, Step
from executor_svc.features.registry import build_features
from executor_svc.runner.batch import BatchInputs
from executor_svc.runner.cuda_graphs import DecodeGraphs, build_decode_graphs
from executor_svc.runner.inputs import build_inputs
from executor_svc.runner.kv_cache import (
    GIB,
    PROFILE_NUM_TOKENS,
    KVCache,
    block_bytes,
    cpu_num_blocks,
    cuda_num_blocks,
    max_useful_blocks,
)
from executor_svc.runner.launched import Launched, SampleResult, sample_results
from executor_svc.runner.loader import ModelInfo, load_model, resolve_device

if TYPE_CHECKING:
    from executor_svc.parallel.group import TPGroup
    from executor_svc.runner.sampler import Sampler, SamplingParams

BlockPairs = list[tuple[int, int]]  # (src, dst) block ids of a cache operation
MAX_PROFILE_SAMPLE_ROWS = 256  # logits rows in the CUDA profiling run (a large decode batch)


@dataclass(slots=True)
class ScheduledSequence:
    seq_id: str
    token_ids: list[int]  # prompt + outputs known so far (runner never mutates it)
    num_prompt_tokens: int
    block_table: list[int]  # device block ids in logical order
    num_computed_tokens: int  # tokens already in the KV cache
    num_scheduled_tokens: int  # compute token_ids[num_computed : num_computed + num_scheduled]
    sampling_params: SamplingParams
    # What features add to the view for this step (their ``prepare`` and step hooks), by
    # feature name; None: nothing (features/base.py ``step_entry``).
    step_data: dict[str, Any] | None = None
    # The SeqState's per-feature entries (SeqState.features), shared: read-only here.
    features: dict[str, Any] | None = None
    # Overlapped steps: (the launched step, its draw's row, the index in token_ids) of a token
    # the host may not have yet (runner/inputs.py gathers it on the device).
    pending: tuple[Launched, int, int] | None = None
    # A token is sampled iff num_computed_tokens + num_scheduled_tokens == len(token_ids), and
    # never for a prompt-only sequence (sampling_params.prompt_only).


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int = 16,
        num_device_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        swap_space_gib: float = 1.0,
        max_model_len: int | None = None,
        attention_backend: str = "auto",
        tp: TPGroup | None = None,
        quantization: str | None = None,
        **feature_options: Any,
    ) -> None:
        """``tp``: this process's rank of a tensor-parallel group (every rank builds its own
        runner, in the same order, since loading and profiling involve collectives).
        ``feature_options``: the configuration of optional features, by the keyword each reads
        (features/registry.py)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.device = resolve_device(device)
        self.backend = get_attention_backend(attention_backend, self.device)
        self.tp = tp
        self.model, self.info = load_model(
            model_dir,
            self.backend,
            device=self.device,
            dtype=dtype,
            max_model_len=max_model_len,
            tp=tp,
            quantization=quantization,
        )
        info: ModelInfo = self.info
        # Built once; each loads its part now (a feature's per-layer deltas before any CUDA
        # graph is captured).
        self.features = build_features(**feature_options)
        ctx = LoadContext(
            self.model, info, self.device, self.backend, tp, load_model, KVCache, block_bytes,
            self.prepare_inputs,
        )  # fmt: skip
        for feature in self.features:
            feature.load(ctx)
        self.block_size = block_size
        bytes_per_block = block_bytes(
            info.num_layers, block_size, info.num_kv_heads, info.head_dim, info.dtype
        )
        # Features' per-block device bytes (a second model's KV) count when sizing the cache,
        # not swap.
        both_bytes = bytes_per_block + sum(f.block_bytes(block_size) for f in self.features)
        cap = max_useful_blocks(info.max_model_len, block_size)
        if num_device_blocks is None:
            if self.device.type == "cuda":
                num_device_blocks = cuda_num_blocks(
                    self._profile_run, self.device, gpu_memory_utilization, both_bytes
                )
            else:
                num_device_blocks = cpu_num_blocks(both_bytes)
            num_device_blocks = min(num_device_blocks, cap)
        if tp is not None:
            # One block table addresses every rank's cache: the smallest one sets the size. Also
            # the point where rank 0 knows every rank has loaded its shard.
            num_device_blocks = tp.min_over_ranks(num_device_blocks)
        if num_device_blocks < 1:
            raise RuntimeError(
                "no memory left for the KV cache; lower the model size or max_model_len"
            )
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = min(int(swap_space_gib * GIB) // bytes_per_block, cap)
        self.kv_cache = KVCache(
            num_layers=info.num_layers,
            num_kv_heads=info.num_kv_heads,
            head_dim=info.head_dim,
            block_size=block_size,
            num_device_blocks=self.num_device_blocks,
            num_cpu_blocks=self.num_cpu_blocks,
            dtype=info.dtype,
            device=self.device,
        )
        for feature in self.features:
            feature.allocate(self.num_device_blocks, block_size)
        # CUDA: decode steps replay captured graphs (runner/cuda_graphs.py); None elsewhere.
        self.graphs: DecodeGraphs | None = None
        if tp is None:
            self.graphs = build_decode_graphs(
                self.model,
                self.kv_cache.layers,
                device=self.device,
                max_model_len=info.max_model_len,
                block_size=block_size,
                num_device_blocks=self.num_device_blocks,
            )
        self._sampler: Sampler | None = None
        # Seconds per phase of execute(), for metrics (plain floats: one add per phase a step).
        # On CUDA also "wait" (the host waiting for a step's draws) and "gpu" (each step's span
        # on the device, from its first operation to its draws' copy: runner/launched.py).
        self.phase_seconds = {"cache_ops": 0.0, "forward": 0.0, "sampling": 0.0}
        self._on_cuda = self.device.type == "cuda"
        if self._on_cuda:
            self.phase_seconds.update(wait=0.0, gpu=0.0)
        # Rank 0 of a tensor-parallel group sends every step to the other ranks first.
        self._send_step = None
        if tp is not None and tp.is_first and tp.world_size > 1:
            from executor_svc.runner.tp_step import send_step

            self._send_step = functools.partial(send_step, tp)
            self.phase_seconds["broadcast"] = 0.0

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def execute(
        self,
        seqs: list[ScheduledSequence],
        blocks_to_swap_out: BlockPairs,
        blocks_to_swap_in: BlockPairs,
        blocks_to_copy: BlockPairs,
        **outputs: list | None,
    ) -> list[SampleResult]:
        """One step: cache operations, inputs, forward, sampling, with the hooks of the features
        the step uses between them; ``outputs``: lists that receive what features return beside
        the samples, by the feature's output name (``Feature.output``; None or absent: not
        wanted)."""
        blocks = (blocks_to_swap_out, blocks_to_swap_in, blocks_to_copy)
        drawn = self._step(seqs, blocks, outputs, defer=False)
        return drawn if isinstance(drawn, list) else drawn.results()

    @torch.inference_mode()
    def launch(
        self,
        seqs: list[ScheduledSequence],
        blocks_to_swap_out: BlockPairs,
        blocks_to_swap_in: BlockPairs,
        blocks_to_copy: BlockPairs,
        *,
        defer: bool = False,
        **outputs: list | None,
    ) -> Launched:
        """``execute`` up to its draws; with ``defer`` (and no feature of the step using them)
        they stay on the device on their way to the host (runner/launched.py)."""
        blocks = (blocks_to_swap_out, blocks_to_swap_in, blocks_to_copy)
        drawn = self._step(seqs, blocks, outputs, defer)
        return drawn if isinstance(drawn, Launched) else Launched.ready(drawn)

    def _step(
        self,
        seqs: list[ScheduledSequence],
        blocks: tuple[BlockPairs, BlockPairs, BlockPairs],
        outputs: dict[str, list | None],
        defer: bool,
    ) -> list[SampleResult] | Launched:
        """The step up to its draws: their results, or the draws as launched (``Launched``: on
        CUDA, and when deferred). A step run through on a CPU makes no ``Launched``: nothing
        there is on its way, and its executor never overlaps (``execute``'s direct path)."""
        if outputs and not outputs.keys() <= self.features.output_names:
            raise TypeError(
                f"no feature returns {sorted(outputs.keys() - self.features.output_names)}"
            )
        step = Step(seqs, self.features.active(seqs) if seqs else (), outputs)
        batch = self._broadcast_step(step, *blocks) if self._send_step is not None else None
        gpu_start = self._device_event() if self._on_cuda else None
        self._cache_ops(*blocks)
        if not seqs:
            return []
        sample_idx, logits = self._forward_step(step, batch)
        if not sample_idx:
            return []
        t0 = time.perf_counter()
        drawn = self._sample_step(step, sample_idx, logits, defer, gpu_start)
        self.phase_seconds["sampling"] += time.perf_counter() - t0
        return drawn

    @staticmethod
    def _device_event() -> torch.cuda.Event:
        """On CUDA, an event at the start of a step (its span on the device: phase "gpu")."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _forward_step(
        self, step: Step, batch: BatchInputs | None
    ) -> tuple[list[int], torch.Tensor]:
        """Inputs (``batch``: already flattened by rank 0's broadcast), forward and the logits of
        the rows that sample."""
        t0 = time.perf_counter()
        for f in step.active:
            f.before_inputs(step)
        if batch is None:
            batch = self.prepare_inputs(step.seqs, features=step.active)
        sample_idx, logits = self._sample_logits(batch, self._forward(step, batch))
        self.phase_seconds["forward"] += time.perf_counter() - t0
        return sample_idx, logits

    def _cache_ops(
        self,
        blocks_to_swap_out: BlockPairs,
        blocks_to_swap_in: BlockPairs,
        blocks_to_copy: BlockPairs,
    ) -> None:
        # Swap-out first: blocks it frees may be the very destinations of this step's swap-in or
        # copies. Copies last: a copy source may be a block just swapped in.
        t0 = time.perf_counter()
        self.kv_cache.swap_out(blocks_to_swap_out)
        self.kv_cache.swap_in(blocks_to_swap_in)
        self.kv_cache.copy(blocks_to_copy)
        for f in self.features.copy_blocks:
            f.copy_blocks(blocks_to_copy)
        self.phase_seconds["cache_ops"] += time.perf_counter() - t0

    def _broadcast_step(
        self,
        step: Step,
        blocks_to_swap_out: BlockPairs,
        blocks_to_swap_in: BlockPairs,
        blocks_to_copy: BlockPairs,
    ) -> BatchInputs | None:
        """Rank 0: flatten the batch (what can reject the step happens before anything is sent)
        and send the step to the other ranks; returns the batch on this rank's device."""
        from executor_svc.runner.tp_step import StepMessage

        t0 = time.perf_counter()
        cpu = torch.device("cpu")
        host = self.prepare_inputs(step.seqs, cpu, step.active) if step.seqs else None
        fields: dict[str, Any] = {}
        for f in step.active:
            f.to_workers(step, fields)
        msg = StepMessage(blocks_to_swap_out, blocks_to_swap_in, blocks_to_copy, host, **fields)
        self._send_step(msg)
        self.phase_seconds["broadcast"] += time.perf_counter() - t0
        return host.to(self.device) if host is not None else None

    @torch.inference_mode()
    def forward_logits(self, seqs: list[ScheduledSequence]) -> tuple[list[int], torch.Tensor]:
        """Forward the step's tokens; logits [num_samples, vocab] fp32 of the sampling ones.
        Single-process runners only (no step is sent to tensor-parallel workers)."""
        if self._send_step is not None:
            raise RuntimeError("forward_logits is not available with tensor parallelism")
        step = Step(seqs, self.features.active(seqs), {})
        batch = self.prepare_inputs(seqs, features=step.active)
        return self._sample_logits(batch, self._forward(step, batch))

    def _forward(self, step: Step, batch: BatchInputs) -> torch.Tensor:
        """Hidden states of the step's tokens, from a CUDA graph for decode batches it holds
        unless a feature changed the model for this step (``step.eager``)."""
        for f in step.active:
            f.before_forward(step)
        if not step.eager and self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch)
        else:
            hidden = self.model(
                batch.input_ids, batch.positions, self.kv_cache.layers, batch.attn_metadata
            )
        for f in step.active:
            f.after_forward(step, hidden)
        return hidden

    def _sample_logits(
        self, batch: BatchInputs, hidden: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        if not batch.sample_seq_indices:
            return [], hidden.new_empty((0, self.info.vocab_size), dtype=torch.float32)
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        return batch.sample_seq_indices, logits.float()

    def prepare_inputs(
        self,
        seqs: list[ScheduledSequence],
        device: torch.device | None = None,
        features: Sequence[Feature] = (),
    ) -> BatchInputs:
        """Flatten the step's sequences onto ``device`` (default: the model's); ``features``:
        the step's, which may change the rows that sample (runner/inputs.py)."""
        return build_inputs(
            seqs,
            block_size=self.block_size,
            max_model_len=self.info.max_model_len,
            device=self.device if device is None else device,
            features=features,
        )

    def _sample_step(
        self,
        step: Step,
        sample_idx: list[int],
        logits: torch.Tensor,
        defer: bool,
        gpu_start: torch.cuda.Event | None = None,
    ) -> list[SampleResult] | Launched:
        """The sequence each logits row samples as (features may give views of it, or change
        the logits), the draws, and one result per sequence (features may group rows). Draws
        stay on the device when ``defer`` and no feature of the step needs them."""
        rows = [step.seqs[i] for i in sample_idx]
        for f in step.active:
            rows = f.before_sample(step, sample_idx, rows, logits)
        defer = defer and not step.active
        drawn = self._sample(rows, logits, defer, gpu_start)
        if defer:
            return drawn
        results = drawn if isinstance(drawn, list) else drawn.results()
        for f in step.active:
            results = f.after_sample(step, sample_idx, results)
        return results

    def _sample(
        self,
        seqs: list[ScheduledSequence],
        logits: torch.Tensor,
        defer: bool = False,
        gpu_start: torch.cuda.Event | None = None,
    ) -> list[SampleResult] | Launched:
        """The draws of ``seqs``: their results where the host has them and nothing waits for
        them (not ``defer``, not CUDA), else as launched."""
        if self._sampler is None:
            # Imported here: the sampler module is optional for forward-only use and tests.
            from executor_svc.runner.sampler import Sampler

            self._sampler = Sampler()
        prompts: list = []
        outputs: list = []
        for s in seqs:
            p, n = s.sampling_params, s.num_prompt_tokens
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                prompts.append(s.token_ids[:n])
                outputs.append(s.token_ids[n:])
            else:
                # The sampler reads only the output's length here (the seeded position): no
                # copy of the whole context per sequence per step.
                prompts.append(())
                outputs.append(range(len(s.token_ids) - n))
        out = self._sampler(logits, [s.sampling_params for s in seqs], prompts, outputs)
        if not (defer or self._on_cuda):
            tops = (out.top_token_ids, out.top_logprobs)
            return sample_results(seqs, out.token_ids, out.logprobs, *tops)
        return Launched.of(seqs, out, self.phase_seconds, gpu_start)

    # ------------------------------------------------------------------ profiling

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """A forward at PROFILE_NUM_TOKENS tokens (plus logits) against a one-block dummy cache;
        slots are -1, so nothing is written, but attention gathers full-length contexts."""
        info, bs = self.info, self.block_size
        seq_len = min(info.max_model_len, PROFILE_NUM_TOKENS)
        num_seqs = max(PROFILE_NUM_TOKENS // seq_len, 1)
        num_tokens = num_seqs * seq_len
        dev = self.device
        dummy = torch.zeros(1, bs, info.num_kv_heads, info.head_dim, dtype=info.dtype, device=dev)
        layers = [(dummy, dummy)] * info.num_layers
        md = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=dev),
            block_tables=torch.zeros(num_seqs, -(-seq_len // bs), dtype=torch.int32, device=dev),
            seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(0, num_tokens + 1, seq_len, dtype=torch.int32, device=dev),
            max_query_len=seq_len,
            max_seq_len=seq_len,
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        positions = torch.arange(seq_len, device=dev).repeat(num_seqs)
        hidden = self.model(input_ids, positions, layers, md)
        rows = hidden[:1].expand(MAX_PROFILE_SAMPLE_ROWS, -1)
        logits = self.model.compute_logits(rows)  # None on tensor-parallel ranks but the first
        if logits is not None:
            torch.softmax(logits.float(), dim=-1)
