"""LLMEngine: requests in, one scheduled and executed step at a time, outputs out."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
import weakref

import torch

from pdserve.core.finish_reason import FinishReason
from pdserve.core.model import ModelConfig, check_prompt
from pdserve.core.sampling import SamplingParams, TokenLogprobs
from pdserve.core.spec_stats import SpecDecodeStats
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import resolve_device, resolve_dtype
from pdserve.engine.kv_cache_manager import KVCacheManager, cdiv
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import EngineInfo, EngineStats, StepOutput
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode import SpecDecoder
from pdserve.engine.structured_output import GrammarCompiler
from pdserve.engine.tensor_parallel import Followers, FollowerSpec, check_divisible
from pdserve.kv.blocks import LAYOUT_VERSION, BlockLayout, ExportedBlock, tail_key
from pdserve.kv.hashing import prompt_block_hashes
from pdserve.settings.engine import EngineArgs
from pdserve.settings.sizes import parse_size
from pdserve.settings.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


class LLMEngine:
    """The model engine shared by prefill and decode workers; it knows nothing of gRPC."""

    def __init__(
        self, args: EngineArgs, model_path: str, grammars: GrammarCompiler | None = None
    ) -> None:
        """``grammars``: the structured output compiler to use (a worker's, loading while
        the model does); default: one of its own, loaded on first use."""
        self.args = args
        self.device = resolve_device(args)
        self._threads_before: int | None = None  # torch's count, where TP changed it
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        elif args.tensor_parallel_size > 1 and self.device.type == "cpu":
            # The ranks share this process's cores: each takes its part of them (N ranks
            # of the whole count each would spin N times as many threads as cores).
            self._threads_before = torch.get_num_threads()
            threads = max(1, self._threads_before // args.tensor_parallel_size)
            args = dataclasses.replace(args, num_threads=threads)
            torch.set_num_threads(threads)
        self.model_config = cfg = ModelConfig.from_dir(model_path)
        self.dtype = resolve_dtype(args, cfg, self.device)
        self.max_model_len = cfg.max_model_len(args.max_model_len)
        tp = args.tensor_parallel_size
        if tp > 1:
            check_divisible(cfg, tp)
        block_bytes = ModelRunner.block_bytes(cfg, args.block_size, self.dtype)
        # --kv-cache-memory is each rank's: a rank holds 1/tp of every block.
        rank_block_bytes = block_bytes // tp
        num_blocks = args.num_kv_blocks or parse_size(args.kv_cache_memory) // rank_block_bytes
        if num_blocks * args.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {args.block_size} tokens "
                f"({num_blocks * args.block_size} tokens), fewer than --max-model-len "
                f"{self.max_model_len}: raise --kv-cache-memory or lower --max-model-len"
            )
        # Tensor parallel: ranks 1..tp-1 start now and load beside this one (rank 0).
        self.followers: Followers | None = None
        group = None
        if tp > 1:
            spec = FollowerSpec(
                args=dataclasses.asdict(args),
                model_path=str(model_path),
                dtype=str(self.dtype).removeprefix("torch."),
                device=str(self.device),
                max_model_len=self.max_model_len,
                num_blocks=num_blocks,
            )
            self.followers = Followers(tp, spec, self.device)
            group = self.followers.group
            self._finalizer = weakref.finalize(self, self.followers.stop, True)
        try:
            self.runner = ModelRunner(
                args, cfg, self.dtype, self.device, self.max_model_len, num_blocks, group
            )
        except BaseException:
            self.close(graceful=False)
            raise
        self.block_bytes = block_bytes
        self.pool = BlockPool(num_blocks)
        self.pool.record_events = False  # on at the first drain_block_events()
        self.kv_cache = KVCacheManager(
            pool=self.pool,
            block_size=args.block_size,
            model_fingerprint=cfg.fingerprint,
            enable_prefix_caching=args.enable_prefix_caching,
            window=cfg.release_window,
        )
        spec_config = SpeculativeConfig.parse(args.speculative_config)
        self.spec = None
        if spec_config is not None:
            proposer = None
            if spec_config.method == "draft_model":
                from pdserve.engine.draft_model import DraftModelProposer

                proposer = DraftModelProposer(
                    spec_config, args, cfg, self.dtype, self.device, self.max_model_len, num_blocks
                )
            self.spec = SpecDecoder(spec_config, self.max_model_len, proposer)
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, self.max_model_len),
            self.kv_cache,
            self.spec,
        )
        self.grammars = grammars or GrammarCompiler(cfg.path, cfg.vocab_size, cfg.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._held: dict[str, Sequence] = {}  # prefilled, blocks kept for export
        self._importing: dict[str, Sequence] = {}  # prefix held, waiting for fetched blocks
        self.num_imported_blocks = 0
        self.num_prefix_imported_blocks = 0  # from a shared prefix tier (import_prefix)
        self.num_imported_bytes = 0
        self.num_rejected_blocks = 0  # fetched but damaged: recomputed instead
        logger.info(
            "engine ready: model=%s dtype=%s device=%s blocks=%d x %d tokens (%.1f MiB) "
            "max_model_len=%d attention=%s step=%s speculative=%s",
            cfg.path,
            self.dtype,
            self.device,
            num_blocks,
            args.block_size,
            num_blocks * block_bytes / 2**20,
            self.max_model_len,
            self.runner.attn.name,
            self.runner.mode,
            spec_config.to_json() if spec_config else "off",
        )

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        prefill_only: bool = False,
    ) -> Sequence:
        """Queue a request; raise ValueError for a prompt the engine cannot serve.

        ``prefill_only`` (prefill workers): finish after the first token, as PREFILLED
        unless that token already ends the request, and keep the prompt's blocks until
        ``export_prompt_blocks``.
        """
        seq = self._new_sequence(prompt_token_ids, params, request_id or uuid.uuid4().hex)
        seq.prefill_only = prefill_only
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _new_sequence(self, prompt: list[int], params: SamplingParams, request_id: str) -> Sequence:
        """A sequence for a request, checked; its grammar compiled here unless cached (a
        worker compiles it off this thread first). ValueError for what cannot be served."""
        if request_id in self._seqs or request_id in self._importing:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.model_config.vocab_size
        check_prompt(prompt, self.max_model_len, vocab)
        outside = [t for t in params.token_ids_used() if t >= vocab]
        if outside:
            raise ValueError(
                f"token id {outside[0]} in the sampling parameters is outside the "
                f"vocabulary [0, {vocab})"
            )
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            params=params,
            eos_token_ids=self.model_config.eos_token_ids,
        )
        if params.structured_outputs is not None:
            seq.grammar = self.grammars.state(params.structured_outputs)
        return seq

    def abort(self, request_id: str) -> bool:
        """Cancel a request wherever it is (queued, running, importing, prefilled) and free
        its blocks at once."""
        seq = self.scheduler.abort(request_id)
        self._seqs.pop(request_id, None)
        for parked in (self._importing, self._held):
            held = parked.pop(request_id, None)
            if held is not None:
                self.kv_cache.free(held)
                seq = seq or held
        return seq is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepOutput:
        """Run one step: schedule, execute, and advance the requests by what was sampled."""
        batch = self.scheduler.schedule()
        if not batch:
            return StepOutput([], [])
        start = time.time()
        output = self.runner.execute(batch)
        end = time.time()
        finished = self.scheduler.update(batch, output)
        for seq, n, tokens in zip(batch.seqs, batch.num_new_tokens, output.token_ids, strict=True):
            seq.times.step(start, end, n, bool(tokens))
        for seq in finished:
            seq.times.finished = end
            self._seqs.pop(seq.request_id, None)
            if seq.finish_reason is FinishReason.PREFILLED:
                self._held[seq.request_id] = seq
        advanced = [
            s
            for s, t in zip(batch.seqs, output.token_ids, strict=True)
            if t or s.finish_reason is FinishReason.ERROR
        ]
        return StepOutput(advanced, finished)

    def close(self, graceful: bool = True) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing for one rank): told to
        stop (``graceful``, from the thread that steps the engine, between steps), or
        killed. The engine cannot step after it."""
        if self.followers is None or not self._finalizer.alive:
            return
        if graceful and self.followers.group.failure is None:  # else a collective hangs
            self._finalizer()
        else:
            self._finalizer.detach()
            self.followers.stop(False)
        if self._threads_before is not None:  # the process's cores are its own again
            torch.set_num_threads(self._threads_before)

    def lost_rank(self) -> str | None:
        """Why a tensor-parallel rank is gone (safe from any thread); None while all run."""
        return self.followers.lost() if self.followers is not None else None

    def stats(self) -> EngineStats:
        spec = self.spec.stats if self.spec is not None else SpecDecodeStats()
        return EngineStats(
            num_total_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_cached_blocks=self.pool.num_cached_blocks,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_imported_blocks=self.num_imported_blocks,
            num_imported_bytes=self.num_imported_bytes,
            num_prefix_imported_blocks=self.num_prefix_imported_blocks,
            num_rejected_blocks=self.num_rejected_blocks,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=tuple(spec.accepted_per_pos),
            rank_imports=tuple(
                (rank, *counts) for rank, counts in sorted(self.runner.rank_imports.items())
            )
            if self.followers is not None
            else (),
        )

    def info(self) -> EngineInfo:
        """What this engine is (model, layout, sizes): fixed for its life."""
        return EngineInfo(
            model_name=self.model_config.path.name,
            fingerprint=self.model_config.fingerprint,
            layout=self.block_layout(),
            num_total_blocks=self.pool.num_blocks,
            max_num_seqs=self.args.max_num_seqs,
            max_model_len=self.max_model_len,
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
            kv_head_start=0,  # whole blocks, whatever --tensor-parallel-size
            total_kv_heads=cfg.num_kv_heads,
        )

    def export_prompt_blocks(self, request_id: str) -> list[ExportedBlock]:
        """The prompt blocks of a PREFILLED request, then its blocks are freed."""
        seq = self._held.pop(request_id)
        try:
            bs = self.args.block_size
            n = seq.num_prompt_tokens
            hashes = self.kv_cache.update_block_hashes(seq)
            count = cdiv(n, bs)
            # One copy of the blocks here; turning them into bytes happens off this thread.
            data = self.runner.read_blocks(seq.block_table[:count]).view(torch.uint8)
            rows = data.reshape(count, -1).numpy()
            blocks = []
            for i in range(count):
                full = (i + 1) * bs <= n
                key = bytes(hashes[i]) if full else tail_key(request_id)
                blocks.append(ExportedBlock(key, memoryview(rows[i]), bs if full else n % bs))
            return blocks
        finally:
            self.kv_cache.free(seq)

    def prefix_to_fetch(self, prompt_token_ids: list[int]) -> list[bytes]:
        """Keys of the prompt's full blocks after the run its prefix cache holds (at least
        one token is left to compute): what a shared prefix tier may supply."""
        if not self.kv_cache.enable_prefix_caching:
            return []
        bs = self.args.block_size
        limit = (len(prompt_token_ids) - 1) // bs
        hashes = prompt_block_hashes(
            prompt_token_ids[: limit * bs], bs, self.kv_cache.model_fingerprint
        )
        held = 0
        while held < len(hashes) and self.pool.lookup(hashes[held]) is not None:
            held += 1
        return [bytes(h) for h in hashes[held:]]

    def import_prefix(self, prompt_token_ids: list[int], fetched: dict[bytes, bytes]) -> int:
        """Put the fetched blocks (by key) that continue the prompt's cached prefix into the
        prefix cache, free and cached (the request then takes them as hits); how many. Only
        into free blocks, and none of a wrong length."""
        bs = self.args.block_size
        limit = (len(prompt_token_ids) - 1) // bs
        hashes = prompt_block_hashes(
            prompt_token_ids[: limit * bs], bs, self.kv_cache.model_fingerprint
        )
        held, blocks = [], []
        for h in hashes:
            block_id = self.pool.lookup(h)
            if block_id is not None:
                if blocks:
                    break  # a cached block after a fetched run: the run ends there
                held.append(block_id)
                continue
            data = fetched.get(bytes(h))
            if data is None or len(data) != self.block_bytes:
                break
            blocks.append((h, data))
        if not blocks:
            return 0
        # The cached blocks the run continues are held meanwhile: allocating must not evict
        # them (the imported blocks would then follow nothing).
        self.pool.touch(held)
        try:
            if len(blocks) > self.pool.num_free_blocks:
                return 0
            ids = self.pool.allocate(len(blocks))
            try:
                self.runner.write_blocks(
                    [(i, data) for i, (_, data) in zip(ids, blocks, strict=True)]
                )
            except BaseException:
                self.pool.free(ids)
                raise
            for block_id, (h, _) in zip(ids, blocks, strict=True):
                self.pool.cache(block_id, h)
            self.pool.free(reversed(ids))
        finally:
            self.pool.free(reversed(held))  # the prefix's first blocks are evicted last
        self.num_prefix_imported_blocks += len(blocks)
        return len(blocks)

    def drain_block_events(self, full: bool) -> tuple[list[bytes], list[bytes]]:
        """Hashes the prefix cache stored and evicted since the last call, for a prefix index;
        with ``full``, every hash it holds now (and no evictions): a fresh start."""
        stored, evicted = self.pool.drain_events()
        if full:
            return self.pool.cached_hashes(), []
        return stored, evicted

    def begin_import(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        first_token: int,
        first_logprob: TokenLogprobs | None,
        resumed: tuple[int, ...] = (),
    ) -> int:
        """Take in a request prefilled elsewhere, whose first token is known: hold the blocks
        of its prompt that this engine's prefix cache has, and return how many there are.
        ``finish_import`` then adds the blocks fetched for the rest, and queues it.

        ``resumed``: tokens generated after the first one elsewhere (a migrated stream).
        They are this request's output, as if generated here: the KV of all but the last
        is recomputed, and seeded draws and penalties go on from them."""
        vocab = self.model_config.vocab_size
        bad = next((t for t in (first_token, *resumed) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"generated token id {bad} is outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) + 1 + len(resumed) > self.max_model_len:
            raise ValueError(
                f"the prompt and the {1 + len(resumed)} tokens generated before pass "
                f"--max-model-len {self.max_model_len}"
            )
        seq = self._new_sequence(prompt_token_ids, params, request_id)
        seq.prompt_logprobs = None  # the worker that prefilled it sent them
        if first_logprob is None and params.logprobs is not None:
            first_logprob = TokenLogprobs(first_token, 0.0, {})  # sent already: a stand-in
        # A grammar follows these tokens as they are appended: its state is rebuilt from
        # them (ValueError when they do not follow it).
        seq.append_token(first_token, first_logprob)
        for token in resumed:
            # The client has these tokens' logprobs already: a stand-in keeps the list
            # aligned with the output, and is never sent.
            seq.append_token(token, TokenLogprobs(token, 0.0, {}))
        num_local = self.kv_cache.take_cached_prefix(seq)
        self._importing[request_id] = seq
        return num_local

    def finish_import(
        self, request_id: str, fetched: dict[bytes, bytes], num_rejected: int = 0
    ) -> Sequence:
        """Import the ``fetched`` blocks (by key) that continue the held prefix; what neither
        covers is recomputed here, as is a block of the wrong length. Queues the request, or
        finishes it if its first token already ends it. ``num_rejected``: blocks the fetch
        refused (header or checksum), counted with those refused here."""
        seq = self._importing.pop(request_id)
        wrong = [k for k, data in fetched.items() if len(data) != self.block_bytes]
        if wrong:
            logger.warning(
                "request %s: %d fetched blocks have the wrong length (not %d bytes); "
                "recomputing them",
                request_id,
                len(wrong),
                self.block_bytes,
            )
            fetched = {k: d for k, d in fetched.items() if len(d) == self.block_bytes}
        self.num_rejected_blocks += num_rejected + len(wrong)
        bs, n = self.args.block_size, seq.num_prompt_tokens
        held = len(seq.block_table)
        blocks: list[tuple[bytes, bytes | None]] = []  # (data, hash to cache)
        for h in self.kv_cache.update_block_hashes(seq)[held : n // bs]:
            if bytes(h) not in fetched:
                break
            blocks.append((fetched[bytes(h)], h))
        covered = (held + len(blocks)) * bs
        if covered == (n // bs) * bs and n % bs and tail_key(request_id) in fetched:
            blocks.append((fetched[tail_key(request_id)], None))
            covered = n
        try:
            imported = self.kv_cache.import_blocks(seq, blocks, self.runner.write_blocks)
        except BaseException:
            self.kv_cache.free(seq)
            raise
        if not imported:  # no room now: what is not held is recomputed when scheduled
            blocks, covered = [], held * bs
        seq.num_computed_tokens = covered
        seq.num_cached_tokens = held * bs
        seq.num_imported_tokens = covered - held * bs
        seq.times.queued = time.time()
        if seq.block_table:  # else the scheduler looks the prompt up (and counts it) itself
            self.kv_cache.record_lookup(n, held * bs)
        self.num_imported_blocks += len(blocks)
        self.num_imported_bytes += sum(len(data) for data, _ in blocks)
        self._seqs[request_id] = seq
        reason = seq.check_stop(self.max_model_len)
        if reason is not None:
            seq.times.finished = seq.times.queued
            self.scheduler.finish_now(seq, reason)
            self._seqs.pop(request_id, None)
        else:
            self.scheduler.add(seq)
        return seq

    def add_imported_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        first_token: int,
        first_logprob: TokenLogprobs | None,
        fetched: dict[bytes, bytes],
    ) -> Sequence:
        """``begin_import`` and ``finish_import`` at once (the blocks are already here)."""
        self.begin_import(prompt_token_ids, params, request_id, first_token, first_logprob)
        return self.finish_import(request_id, fetched)
