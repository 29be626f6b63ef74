"""Runs a scheduled batch through the model over the paged KV cache, and samples.

The one place that decides how a step executes:

- CUDA: decode steps replay a CUDA graph per batch-size bucket (``cuda_graphs``); other
  steps run eagerly;
- CPU: every step runs the model compiled by inductor once, with a dynamic token count
  (its linears and attention are opaque ops; inductor fuses the code between them). Where
  the C++ operators build (``ops.cpu_ops_error``), those ops are C++ and inductor emits its
  C++ wrapper: a decode step is one call into C++ that runs without the GIL;
- ``--enforce-eager`` (or a device with neither): the plain PyTorch model.

Step inputs live in persistent buffers (``StepInputs``); the KV cache is one tensor whose
blocks hold all layers together, so that a block exports as one buffer.

Tensor parallel (``group``): every rank has a runner over its shard of the weights and of
the KV heads. Rank 0's ``execute`` sends each step's inputs to the others, which run the
same forward and logits (``follow``); it alone samples. Blocks are read and written whole
on rank 0, each rank's KV-head range sent to it and gathered from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import time
import warnings
from collections.abc import Iterator

import torch

from pdserve.core.model import ModelConfig
from pdserve.core.sampling import TokenLogprobs
from pdserve.engine.attention import AttentionMetadata, get_attention_backend
from pdserve.engine.cuda_graphs import CudaGraphRunner, bucket_for, decode_buckets
from pdserve.engine.forward_context import ForwardContext, forward_context
from pdserve.engine.model import ops
from pdserve.engine.model.cpu_linear import describe, pack_linears, packing_available
from pdserve.engine.model.loader import load_model
from pdserve.engine.outputs import ModelRunnerOutput
from pdserve.engine.sampler import Sampler, token_logprobs
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.spec_decode import default_rule
from pdserve.engine.step_inputs import PreparedStep, StepInputs
from pdserve.engine.structured_output import step_bitmask
from pdserve.engine.tensor_parallel import RankGroup, RankLost, Shard
from pdserve.kernels import sample_cpu
from pdserve.settings.engine import EngineArgs

logger = logging.getLogger(__name__)


# The most positions rotary tables cover beyond --max-model-len (a 16k-position table of
# head_dim 128 takes 16 MiB in float32).
ROPE_POSITIONS = 16384
# Attention backends whose kernels a CUDA graph can capture (no reads back to the host).
GRAPH_BACKENDS = ("triton",)
# Models one process may compile (dynamo's recompile limit of one code object).
MAX_COMPILED_ENGINES = 256
# Prompt positions whose logits are computed at once for prompt logprobs ([rows, vocab]).
PROMPT_LOGPROB_ROWS = 256


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _return_freed_memory() -> None:
    """Hand the heap that loading and packing freed back to the OS (glibc keeps it)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class ModelRunner:
    """Owns the weights, the KV cache tensor and the step inputs; one ``execute`` per step."""

    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        num_blocks: int,
        group: RankGroup | None = None,
    ) -> None:
        self.cfg = model_config
        self.group = group
        self.shard = group.shard() if group is not None else Shard()
        # This rank's KV heads: [start, end) of the model's.
        self.kv_heads = self.shard.range(model_config.num_kv_heads)
        # Per rank (rank 0 keeps all): blocks and bytes each imported into its own cache.
        self.rank_imports: dict[int, tuple[int, int]] = {}
        self.dtype = dtype
        self.device = device
        self.block_size = args.block_size
        self.attn = get_attention_backend(args.attention_backend, device)
        # Rotary tables for the model's own length (up to ROPE_POSITIONS) whatever
        # --max-model-len says: the compiled graph, and its cache entry, are then the same
        # for every engine of a model and dtype.
        rope = max(max_model_len, min(model_config.max_model_len(None), ROPE_POSITIONS))
        self.model = load_model(model_config, dtype, device, rope, self.shard)
        # The C++ CPU ops take the packed linears and the C attention kernels.
        self.cpp_ops = (
            device.type == "cpu"
            and packing_available(dtype)
            and self.attn.name == "cpu"
            and ops.cpu_ops_error() is None
        )
        self.linears = (
            pack_linears(self.model, self.cpp_ops)
            if device.type == "cpu" and packing_available(dtype)
            else []
        )
        if self.linears:
            logger.info("CPU linears packed: %s", describe(self.linears))
        for module in self.model.modules():
            if hasattr(module, "cpp_op"):  # the attention layers
                module.cpp_op = self.cpp_ops
            if hasattr(module, "shared_regions"):  # the decoder layers
                module.shared_regions = not self.cpp_ops and self.model.uniform_layers
        # kv: [num_blocks, num_layers, 2 (k, v), num_kv_heads, block_size, head_dim]
        # Kernels see each layer as [num_blocks, block_size, num_kv_heads, head_dim] views
        # (strided); head-major storage keeps a head's block contiguous.
        self.kv = torch.zeros(
            num_blocks,
            model_config.num_layers,
            2,
            self.kv_heads[1] - self.kv_heads[0],
            self.block_size,
            model_config.head_dim,
            dtype=dtype,
            device=device,
        )
        self.kv_caches = [
            (self.kv[:, i, 0].transpose(1, 2), self.kv[:, i, 1].transpose(1, 2))
            for i in range(model_config.num_layers)
        ]
        self.sampler = Sampler(args.seed)
        if device.type == "cpu":
            sample_cpu.available()  # builds greedy's argmax kernel before the first step
        # Speculative decoding's acceptance rule (``spec_decode``); the engine sets it.
        self.acceptance_rule = default_rule
        use_graphs = device.type == "cuda" and not args.enforce_eager
        if use_graphs and model_config.is_moe:
            # The expert op reads its rows per expert back to the host (moe.py).
            logger.info("a mixture of experts: decode steps run eagerly on CUDA")
            use_graphs = False
        if use_graphs and self.attn.name not in GRAPH_BACKENDS:
            # The torch reference reads values back to the host (a mask's any(), lengths),
            # which a stream being captured does not allow.
            logger.info("attention backend %s: decode steps run eagerly", self.attn.name)
            use_graphs = False
        self.buckets = decode_buckets(args.max_num_seqs) if use_graphs else []
        self.inputs = StepInputs(
            max_tokens=max(args.max_num_batched_tokens, args.max_num_seqs) + 2,
            max_seqs=args.max_num_seqs + 2,
            max_blocks=cdiv(max_model_len, self.block_size),
            block_size=self.block_size,
            device=device,
        )
        self.graphs: CudaGraphRunner | None = None
        self._forward = self.model
        self.mode = "eager"
        if use_graphs:
            self.graphs = CudaGraphRunner(self.model, self.inputs, self._context, self.buckets)
            self.mode = "cuda-graphs"
        elif device.type == "cpu" and not args.enforce_eager:
            self._forward = self._compile_for_cpu()
            self.mode = "compiled"
        _return_freed_memory()

    def _context(self, meta: AttentionMetadata | None) -> ForwardContext:
        return ForwardContext(self.attn, self.kv_caches, meta, self.linears)

    def _step_context(self, meta: AttentionMetadata):
        """What a forward of this step reads: the forward context, and the C++ ops' step."""
        stack = contextlib.ExitStack()
        stack.enter_context(forward_context(self._context(meta)))
        if self.cpp_ops:
            stack.enter_context(ops.cpu_step(self.kv, meta))
        return stack

    def _compile_for_cpu(self):
        """The model compiled by inductor for any token count >= 2, compiled now (cached on
        disk, see ``pdserve.engine``, so a second start only retraces)."""
        # Each engine's model is compiled on its own (dynamo guards on the module), and all
        # are entries of one code object, LlamaForCausalLM.forward: past dynamo's limit of
        # 8 a process's next engine would fail to compile (fullgraph). Engines of a process
        # (tests, an application's LLM objects) are fewer than this; a worker has one.
        limit = max(torch._dynamo.config.recompile_limit, MAX_COMPILED_ENGINES)
        torch._dynamo.config.recompile_limit = limit
        # The wrapper and the kernels built apart: the wrapper (30 layers of calls) at -O1.
        options = (
            {"cpp_wrapper": True, "cpp_wrapper_build_separate": True} if self.cpp_ops else None
        )
        compiled = torch.compile(self.model, fullgraph=True, dynamic=False, options=options)
        started = time.perf_counter()
        step = self.inputs.prepare([], [], pad_decode_to=2)
        ids, positions = self.inputs.input_ids[:2], self.inputs.positions[:2]
        torch._dynamo.mark_dynamic(ids, 0)  # one graph for every token count >= 2
        torch._dynamo.mark_dynamic(positions, 0)
        with torch.inference_mode(), self._step_context(step.meta):
            compiled(ids, positions)
        logger.info("compiled the model for the CPU in %.1f s", time.perf_counter() - started)
        return compiled

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of blocks' KV on the CPU, one block per row: [n, layers, 2, kv_heads,
        block_size, head_dim] (each row is a block's export buffer), every KV head of the
        model's (a tensor-parallel runner gathers the other ranks' heads)."""
        local = self._read_local(block_ids)
        if self.group is None:
            return local
        self.group.broadcast_object(("read", block_ids))
        parts = [local]
        for rank in range(1, self.shard.size):
            parts.append(self.group.recv(torch.empty_like(local), rank))
        return torch.cat(parts, dim=3)

    def _read_local(self, block_ids: list[int]) -> torch.Tensor:
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return self.kv.index_select(0, index).cpu()

    def write_blocks(self, blocks: list[tuple[int, bytes | memoryview]]) -> None:
        """Fill blocks from buffers made by ``read_blocks`` on a worker with the same layout
        (all KV heads): (block id, bytes) each. A tensor-parallel runner sends each rank
        its heads only."""
        if not blocks:
            return
        block_shape = (self.cfg.num_layers, 2, self.cfg.num_kv_heads, *self.kv.shape[4:])
        want = math.prod(block_shape) * self.kv.element_size()
        rows = []
        for _, data in blocks:
            if len(data) != want:
                raise ValueError(
                    f"block data has {len(data)} bytes, this worker's blocks have {want}"
                )
            with warnings.catch_warnings():  # read-only use of an immutable buffer
                warnings.simplefilter("ignore", UserWarning)
                rows.append(torch.frombuffer(data, dtype=self.kv.dtype).view(block_shape))
        data = torch.stack(rows)  # [n, layers, 2, kv_heads, block_size, head_dim]
        ids = [block_id for block_id, _ in blocks]
        if self.group is not None:
            self.group.broadcast_object(("write", ids))
            for rank in range(1, self.shard.size):
                start, end = Shard(rank, self.shard.size).range(self.cfg.num_kv_heads)
                self.group.send(data[:, :, :, start:end], rank)
            for rank in range(1, self.shard.size):
                self.rank_imports[rank] = tuple(
                    self.group.recv(torch.zeros(2, dtype=torch.int64), rank).tolist()
                )
        start, end = self.kv_heads
        self._write_local(ids, data[:, :, :, start:end])

    def _write_local(self, ids: list[int], data: torch.Tensor) -> None:
        index = torch.tensor(ids, dtype=torch.int64, device=self.device)
        self.kv.index_copy_(0, index, data.to(self.device))
        blocks, nbytes = self.rank_imports.get(self.shard.rank, (0, 0))
        self.rank_imports[self.shard.rank] = (
            blocks + len(ids),
            nbytes + data.numel() * data.element_size(),
        )

    # --- a tensor-parallel follower (ranks 1..N-1) -------------------------------------

    def follow(self, command: tuple) -> None:
        """Run one of rank 0's commands (``pdserve.engine.tensor_parallel.follow``)."""
        kind = command[0]
        if kind == "step":
            self._follow_step(command[1])
        elif kind == "read":
            self.group.send(self._read_local(command[1]), 0)
        elif kind == "write":
            ids = command[1]
            shape = (len(ids), *self.kv.shape[1:])
            data = self.group.recv(torch.empty(shape, dtype=self.kv.dtype), 0)
            self._write_local(ids, data)
            self.group.send(torch.tensor(self.rank_imports[self.shard.rank]), 0)
        else:
            raise RuntimeError(f"bug: unknown tensor-parallel command {kind!r}")

    @torch.inference_mode()
    def _follow_step(self, message: tuple[dict, int]) -> None:
        snapshot, bucket = message
        step = self.inputs.restore(snapshot)
        with self._step_context(step.meta):
            hidden = self._run(step, bucket)
            _, prompt = self._logits(hidden, step)
            for _ in prompt:
                pass

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one KV block (all layers, K and V, every KV head)."""
        return block_size * cfg.kv_bytes_per_token(dtype.itemsize)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """Run one step over ``batch``; its samples, index-aligned with ``batch.seqs``."""
        if self.group is None:
            return self._execute(batch)
        try:
            return self._execute(batch)
        except RankLost:
            raise
        except Exception as error:
            # The other ranks may wait in a collective this rank never reached: any next
            # step would pair with it. The engine is over.
            self.group.failure = f"rank 0 failed mid-step ({error!r}); the ranks are out of step"
            raise RankLost(self.group.failure) from error

    def _execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        bucket = self._decode_bucket(batch)
        step = self.inputs.prepare(batch.seqs, batch.num_new_tokens, bucket, batch.draft_token_ids)
        if self.group is not None:
            self.group.broadcast_object(("step", (self.inputs.snapshot(step), bucket)))
        with self._step_context(step.meta):
            hidden = self._run(step, bucket)
            logits, prompt_logits = self._logits(hidden, step)
            prompt_logprobs = self._prompt_logprobs(batch, step, prompt_logits)
        order = step.sample_order
        seqs = [batch.seqs[i] for i in order]
        # A speculating sequence's rows draw its next tokens in turn (a seeded draw is
        # seeded by the token's index).
        offsets = [0] * len(order)
        for k in range(1, len(order)):
            if order[k] == order[k - 1]:
                offsets[k] = offsets[k - 1] + 1
        bitmask = step_bitmask(seqs, offsets, batch.draft_token_ids, self.cfg.vocab_size)
        tokens, logprobs, errors = self.sampler(logits, seqs, offsets, bitmask)
        n = len(batch.seqs)
        token_ids: list[list[int]] = [[] for _ in range(n)]
        token_logprobs: list[list] = [[] for _ in range(n)]
        row_errors = [None] * n if any(errors) else None
        first_row: dict[int, int] = {}  # a sequence's rows are consecutive
        for k, i in enumerate(order):
            first_row.setdefault(i, k)
            if errors[k] is not None:
                row_errors[i] = row_errors[i] or errors[k]
            else:
                token_ids[i].append(tokens[k])
                token_logprobs[i].append(logprobs[k])
        for i, seq in enumerate(batch.seqs):
            drafts = batch.draft_token_ids.get(seq.request_id)
            if drafts and not (row_errors and row_errors[i]):
                rows = logits[first_row[i] : first_row[i] + len(drafts) + 1]
                token_ids[i] = self.acceptance_rule(drafts, token_ids[i], rows, seq)
                del token_logprobs[i][len(token_ids[i]) :]
        return ModelRunnerOutput(token_ids, token_logprobs, row_errors, prompt_logprobs)

    def _logits(
        self, hidden: torch.Tensor, step: PreparedStep
    ) -> tuple[torch.Tensor, Iterator[torch.Tensor]]:
        """The sampled rows' logits, and those of the prompt-logprob rows in slices, each
        computed when taken (a row of logits is the vocabulary's size). Every rank of a
        tensor-parallel model computes the same, in the same order."""
        logits = self.model.compute_logits(hidden[step.logit_rows])
        prompt = (
            self.model.compute_logits(
                hidden[first + at : first + min(count, at + PROMPT_LOGPROB_ROWS)]
            )
            for _, first, _, count in step.prompt_rows
            for at in range(0, count, PROMPT_LOGPROB_ROWS)
        )
        return logits, prompt

    def _prompt_logprobs(
        self, batch: ScheduledBatch, step: PreparedStep, prompt_logits: Iterator[torch.Tensor]
    ) -> dict[int, list[TokenLogprobs]] | None:
        """The prompt logprobs of the step's rows that give them, by batch index."""
        if not step.prompt_rows:
            return None
        out: dict[int, list[TokenLogprobs]] = {}
        for i, _, position, count in step.prompt_rows:
            seq = batch.seqs[i]
            lps: list[TokenLogprobs] = []
            for at in range(0, count, PROMPT_LOGPROB_ROWS):
                n = min(PROMPT_LOGPROB_ROWS, count - at)
                raw = next(prompt_logits).float()
                p = position + at
                nxt = seq.prompt_token_ids[p + 1 : p + 1 + n]
                top = [seq.params.prompt_logprobs] * n
                lps += token_logprobs(raw, nxt, top)
            out[i] = lps
        return out

    def _decode_bucket(self, batch: ScheduledBatch) -> int:
        """Rows to pad the decode part to: a graph's bucket, 2 for a compiled step of one
        token (the compiled model is specialised for >= 2), else 0 (no padding)."""
        if self.graphs is not None and all(n == 1 for n in batch.num_new_tokens):
            return bucket_for(len(batch.seqs), self.buckets) or 0
        if self.mode == "compiled" and batch.total_tokens == 1:
            return 2
        return 0

    def _run(self, step: PreparedStep, bucket: int) -> torch.Tensor:
        """[num_tokens, hidden] for the prepared step."""
        if self.graphs is not None and bucket and step.num_tokens == step.num_decode:
            return self.graphs.replay(bucket)
        n = step.num_tokens
        return self._forward(self.inputs.input_ids[:n], self.inputs.positions[:n])
