"""pretrain_gpt.py under Megatron-FSDP with the FSDP hook's collectives recorded and
randomly delayed (as tests/record_collectives.py), the compressed buckets' shard and
bucket sizes printed (``SHARDS rank=R numel=n1,n2,... buckets=b1,b2,...``) and, before every step after the
first, a check that every HSDP replica holds bit-identical parameter shards: each rank
compares its local shards with the ranks of its outer (cross-node) group and prints
``REPLICAS rank=R iter=I identical=B`` (one write per line), the number of
asynchronous parameter all-gather handles Megatron-FSDP still holds when the previous
optimizer step has returned (``GATHERS rank=R iter=I in_flight=N``) and, once megatron's
own wait has finished those gathers, whether each bucket holds what a synchronous
all-gather of the shards gives (``GATHERED rank=R iter=I buckets=N equal=B``)."""

import json
import os
import pathlib
import random
import sys
import warnings

import torch
import torch.distributed as dist

from loco_megatron.cli import main_config
from loco_megatron.loco.hooks import FsdpGradHook
from loco_megatron.training.trainer import train
from record_collectives import recording_ops


def gathers_in_flight(chunks) -> int:
    """Work handles of asynchronous (coalesced) parameter all-gathers that Megatron-FSDP's
    all-gather pipeline holds and has not waited for: 0 when every gather is synchronous."""
    return sum(len(getattr(event, "works", ())) for chunk in chunks
               for event, _ in chunk.module.all_gather_pipeline.param_gather_event_map.values())


def finish_and_check_gathers(chunks) -> tuple[int, bool]:
    """Waits, through megatron's ``wait_bucket_ready``, for every parameter all-gather in
    flight and compares each bucket with a synchronous all-gather of the same shards:
    (buckets checked, all equal)."""
    checked, equal = 0, True
    for chunk in chunks:
        pipeline = chunk.module.all_gather_pipeline
        for bucket_id, bwd in sorted(pipeline.param_gather_event_map):  # the same buckets on every rank
            pipeline.wait_bucket_ready(bucket_id, bwd)
            wbuf = pipeline.get_fsdp_buffer(bucket_id, bwd)
            got = wbuf.fetch_bucket().data
            want = torch.empty_like(got)
            dist.all_gather_into_tensor(want, wbuf.get_shard_from_local_buffer().clone(),
                                        group=wbuf.data_parallel_group)
            checked, equal = checked + 1, equal and torch.equal(got, want)
    return checked, equal


class CheckedFsdpHook(FsdpGradHook):
    def __init__(self, chunks, loco, stats, ops):
        self._chunks, self._it = chunks, 0
        super().__init__(chunks, loco, stats, ops=ops)
        ids = [int(k[len("fsdp.bucket"):]) for k in self.compressors]
        sizes = [self._shard(i).numel() for i in ids]
        buckets = [self._gbuf(i).bucket_index.size for i in ids]
        os.write(1, f"SHARDS rank={dist.get_rank()} numel={','.join(map(str, sizes))} "
                    f"buckets={','.join(map(str, buckets))}\n".encode())

    @property
    def iteration(self) -> int:
        return self._it

    @iteration.setter
    def iteration(self, value: int) -> None:
        self._it = value
        if value == 0:
            return
        rank = dist.get_rank()
        os.write(1, f"GATHERS rank={rank} iter={value} in_flight={gathers_in_flight(self._chunks)}\n".encode())
        checked, equal = finish_and_check_gathers(self._chunks)
        os.write(1, f"GATHERED rank={rank} iter={value} buckets={checked} equal={equal}\n".encode())
        if self._outer is None:
            return
        local = [p.to_local() if hasattr(p, "to_local") else p for c in self._chunks for p in c.parameters()]
        flat = torch.cat([t.detach().reshape(-1).float() for t in local])
        everyone = [torch.empty_like(flat) for _ in range(self._outer.size())]
        dist.all_gather(everyone, flat, group=self._outer)
        same = all(torch.equal(e, flat) for e in everyone) and bool(torch.isfinite(flat).all())
        sys.stdout.flush()
        os.write(1, f"REPLICAS rank={dist.get_rank()} iter={value} identical={same} numel={flat.numel()}\n".encode())


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    config, env = main_config(sys.argv[1:])
    log: list = []
    ops = recording_ops(log, random.Random(1000 + env.rank))
    train(config, env, grad_sync_factory=lambda chunks, loco, stats: CheckedFsdpHook(chunks, loco, stats, ops))
    out = pathlib.Path(os.environ["LOCO_TEST_RECORD_DIR"]) / f"rank{env.rank}.json"
    out.write_text(json.dumps(log))
