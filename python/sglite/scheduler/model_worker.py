"""ModelWorker: runs a ForwardInput on the ModelRunner (forward + sample) for the scheduler."""

from __future__ import annotations

import numpy as np
import torch

from sglite.model_executor.forward_batch import ForwardBatch
from sglite.model_executor.sampler import SamplingBatchInfo
from sglite.scheduler.batch import ForwardInput, Mode
from sglite.scheduler.worker import Worker


class ModelWorker(Worker):
    def __init__(self, runner, seed: int = 0):
        self.runner = runner
        self.vocab_size = runner.model_config.vocab_size
        self.eos_token_ids = tuple(runner.model_config.eos_token_ids)
        torch.manual_seed(seed)  # requests without a seed draw from torch's RNG

    def run(self, fi: ForwardInput) -> np.ndarray:
        r = self.runner
        pool = r.req_to_token_pool
        if fi.table_rows is not None:  # the scheduler's host table is mirrored on the device
            width = fi.table_rows.shape[1]
            rows = torch.from_numpy(fi.rows).to(r.device)
            pool.req_to_token[rows, :width] = torch.from_numpy(fi.table_rows).to(r.device)
        if fi.mode == Mode.DECODE:
            batch = ForwardBatch.decode(
                input_ids=fi.input_ids,
                seq_lens=fi.seq_lens,
                req_pool_indices=fi.rows,
                out_cache_loc=fi.out_cache_loc,
                req_to_token_pool=pool,
                kv_pool=r.kv_pool,
            )
        else:
            lens = fi.seq_lens - fi.prefix_lens
            batch = ForwardBatch.extend(
                input_ids=np.split(fi.input_ids, np.cumsum(lens)[:-1]),
                prefix_lens=fi.prefix_lens,
                req_pool_indices=fi.rows,
                out_cache_loc=fi.out_cache_loc,
                req_to_token_pool=pool,
                kv_pool=r.kv_pool,
                mixed=fi.mode == Mode.MIXED,
            )
        logits = r.forward(batch)
        info = SamplingBatchInfo.build(
            fi.sampling_params,
            vocab_size=self.vocab_size,
            device=r.device,
            output_ids=[p[1] if p is not None else () for p in fi.penalty_tokens],
            output_lens=np.maximum(fi.seq_lens - fi.prompt_lens, 0).tolist(),
            prompt_ids=[p[0] if p is not None else () for p in fi.penalty_tokens],
            eos_token_ids=self.eos_token_ids,
        )
        return r.sample(logits, info).cpu().numpy()
