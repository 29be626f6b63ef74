"""LLMEngine: requests in, one scheduled and executed step at a time, outputs out."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import torch

from services.engine.block_pool import BlockPool
from services.engine.config import EngineArgs, ModelConfig, parse_size, resolve_dtype
from services.engine.kv_cache_manager import KVCacheManager, cdiv
from services.engine.kv_transfer import LAYOUT_VERSION, BlockLayout, ExportedBlock, tail_key
from services.engine.model_runner import ModelRunner
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import Sequence, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """Counters a user or a test reads: cache hits, preemptions, blocks."""

    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_running: int
    num_waiting: int


class LLMEngine:
    """The model engine shared by prefill and decode workers; it knows nothing of gRPC."""

    def __init__(self, args: EngineArgs, model_path: str) -> None:
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.device = args.resolved_device()
        self.model_config = cfg = ModelConfig.from_dir(model_path)
        self.dtype = resolve_dtype(args.dtype, cfg.checkpoint_dtype, self.device)
        self.max_model_len = self._max_model_len(args, cfg)
        block_bytes = ModelRunner.block_bytes(cfg, args.block_size, self.dtype)
        num_blocks = args.num_kv_blocks or parse_size(args.kv_cache_memory) // block_bytes
        if num_blocks * args.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {args.block_size} tokens "
                f"({num_blocks * args.block_size} tokens), fewer than --max-model-len "
                f"{self.max_model_len}: raise --kv-cache-memory or lower --max-model-len"
            )
        self.runner = ModelRunner(
            args, cfg, self.dtype, self.device, self.max_model_len, num_blocks
        )
        self.pool = BlockPool(num_blocks)
        self.pool.record_events = False  # on at the first drain_block_events()
        self.kv_cache = KVCacheManager(
            pool=self.pool,
            block_size=args.block_size,
            model_fingerprint=cfg.fingerprint,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, self.max_model_len),
            self.kv_cache,
        )
        self._seqs: dict[str, Sequence] = {}
        self._held: dict[str, Sequence] = {}  # finished, blocks kept for export
        self.num_imported_blocks = 0
        self.num_imported_bytes = 0
        logger.info(
            "engine ready: model=%s dtype=%s device=%s blocks=%d x %d tokens (%.1f MiB) "
            "max_model_len=%d attention=%s",
            cfg.path,
            self.dtype,
            self.device,
            num_blocks,
            args.block_size,
            num_blocks * block_bytes / 2**20,
            self.max_model_len,
            self.runner.attn.name,
        )

    @staticmethod
    def _max_model_len(args: EngineArgs, cfg: ModelConfig) -> int:
        limit = cfg.max_position_embeddings
        if cfg.sliding_window:
            limit = min(limit, cfg.sliding_window)
        if args.max_model_len is None:
            return limit
        if args.max_model_len > limit:
            raise ValueError(
                f"--max-model-len {args.max_model_len} exceeds what the model supports ({limit})"
            )
        return args.max_model_len

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> Sequence:
        """Queue a request; raise ValueError for a prompt the engine cannot serve."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def validate_prompt(self, token_ids: list[int]) -> None:
        """Refuse an empty prompt, bad token ids, or one that leaves no room to generate."""
        if len(token_ids) == 0:
            raise ValueError("the prompt is empty: send at least one token")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but --max-model-len is "
                f"{self.max_model_len}: it must be shorter to leave room for output"
            )

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks at once."""
        seq = self.scheduler.abort(request_id)
        self._seqs.pop(request_id, None)
        return seq is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[list[Sequence], list[Sequence]]:
        """Run one step. Returns (sequences that got a token, sequences that finished)."""
        batch = self.scheduler.schedule()
        if not batch:
            return [], []
        results = self.runner.execute(batch)
        sampled = [None if r is None else r[0] for r in results]
        for seq, r in zip(batch.seqs, results, strict=True):
            if r is not None and r[1] is not None and seq.logprobs is not None:
                seq.logprobs.append(r[1])
        finished = self.scheduler.update(batch, sampled)
        for seq in finished:
            self._seqs.pop(seq.request_id, None)
            if seq.hold_blocks:
                self._held[seq.request_id] = seq
        advanced = [s for s, t in zip(batch.seqs, sampled, strict=True) if t is not None]
        return advanced, finished

    def stats(self) -> EngineStats:
        return EngineStats(
            num_total_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_cached_blocks=self.pool.num_cached_blocks,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
        )

    # --- KV transfer -------------------------------------------------------------

    def block_layout(self) -> BlockLayout:
        cfg = self.model_config
        return BlockLayout(
            version=LAYOUT_VERSION,
            model_fingerprint=cfg.fingerprint,
            dtype=str(self.dtype).removeprefix("torch."),
            block_size=self.args.block_size,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
        )

    def export_prompt_blocks(self, request_id: str) -> list[ExportedBlock]:
        """The prompt blocks of a finished ``hold_blocks`` request, then its blocks are freed."""
        seq = self._held.pop(request_id)
        try:
            bs = self.args.block_size
            n = seq.num_prompt_tokens
            hashes = self.kv_cache.update_block_hashes(seq)
            blocks = []
            for i in range(cdiv(n, bs)):
                full = (i + 1) * bs <= n
                key = bytes(hashes[i]) if full else tail_key(request_id)
                data = self.runner.read_block(seq.block_table[i])
                blocks.append(ExportedBlock(key, data, bs if full else n % bs))
            return blocks
        finally:
            self.kv_cache.free(seq)

    def release_held(self, request_id: str) -> None:
        """Free a held request's blocks without exporting them."""
        seq = self._held.pop(request_id, None)
        if seq is not None:
            self.kv_cache.free(seq)

    def drain_block_events(self, full: bool) -> tuple[list[bytes], list[bytes]]:
        """Hashes the prefix cache stored and evicted since the last call, for a prefix index;
        with ``full``, every hash it holds now (and no evictions): a fresh start."""
        stored, evicted = self.pool.drain_events()
        if full:
            return self.pool.cached_hashes(), []
        return stored, evicted

    def local_prefix_hashes(self, hashes: list[bytes]) -> int:
        """How many leading full-block hashes this engine's prefix cache holds."""
        n = 0
        for h in hashes:
            if self.pool.lookup(h) is None:
                break
            n += 1
        return n

    def add_imported_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        first_token: int,
        first_logprob: TokenLogprobs | None,
        fetched: dict[bytes, bytes],
    ) -> Sequence:
        """Queue a request prefilled elsewhere: its first token is known, and its prompt's KV
        comes from this engine's own prefix cache, then from ``fetched`` blocks; whatever is
        in neither is recomputed here."""
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_prompt(prompt_token_ids)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        bs, n = self.args.block_size, len(prompt_token_ids)
        hashes = self.kv_cache.update_block_hashes(seq)[: n // bs]
        hits = []
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        imports: list[tuple[bytes, bytes | None]] = []  # (data, hash to index)
        for h in hashes[len(hits) :]:
            if bytes(h) not in fetched:
                break
            imports.append((fetched[bytes(h)], h))
        covered = (len(hits) + len(imports)) * bs
        if covered == (n // bs) * bs and n % bs and tail_key(request_id) in fetched:
            imports.append((fetched[tail_key(request_id)], None))
            covered = n
        revived = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        if revived + len(imports) > self.pool.num_free_blocks:  # no room now: recompute later
            hits, imports, covered = [], [], 0
        if hits or imports:
            self.pool.touch(hits)
            new_blocks = self.pool.allocate(len(imports))
            for block, (data, block_hash) in zip(new_blocks, imports, strict=True):
                self.runner.write_block(block, data)
                if block_hash is not None:
                    self.pool.cache(block, block_hash)
            seq.block_table = hits + new_blocks
            self.kv_cache.mark_cached(seq, len(hits) + sum(h is not None for _, h in imports))
            self.num_imported_blocks += len(imports)
            self.num_imported_bytes += sum(len(d) for d, _ in imports)
        seq.num_computed_tokens = covered
        seq.num_cached_tokens = len(hits) * bs
        seq.num_imported_tokens = covered - len(hits) * bs
        if hits or imports:  # else the scheduler looks the prompt up (and counts it) itself
            self.kv_cache.record_lookup(n, len(hits) * bs)
        seq.append_token(first_token)
        if seq.logprobs is not None and first_logprob is not None:
            seq.logprobs.append(first_logprob)
        self._seqs[request_id] = seq
        reason = seq.check_stop(self.max_model_len)
        if reason is not None:
            self.scheduler.finish_now(seq, reason)
            self._seqs.pop(request_id, None)
        else:
            self.scheduler.add(seq)
        return seq
