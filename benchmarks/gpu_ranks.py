"""pretrain_gpt.py with every rank on the one GPU, over gloo (``benchmarks/gpu_check.sh``).

NCCL refuses two ranks on one device, so a machine with one GPU cannot otherwise run the
multi-rank GPU path: LoCo's compression between ranks, the Triton kernels on real
buckets, the compressed parameter gather, a save and a resume. Here every rank computes
on ``cuda:0`` and communicates over gloo (:func:`loco_megatron.platform.gloo_on_one_gpu`);
the collectives gloo implements for CPU tensors only run on host copies
(:func:`loco_megatron.platform.gloo_cuda_staging`, entered by the platform layer), so
the exchanged values are exactly a GPU cluster's, at host-copy speed. Megatron's own
coalesced bucket collectives are not staged: run it with LoCo on (``--loco-bits``,
``--param-gather-bits``), which replaces them.

    torchrun --standalone --nproc_per_node 2 benchmarks/gpu_ranks.py --loco-bits 4 ...
    python benchmarks/gpu_ranks.py --compare FULL.jsonl RESUMED.jsonl

``--compare``: the resumed run's training losses must equal the unbroken run's at every
iteration the resumed run logged (bit for bit: the JSON floats are exact); one line,
exit 1 when they differ or the resumed run logged nothing.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def losses(path: str) -> dict:
    """{iteration: train/lm_loss} of a metrics file."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r["iteration"]: r["train/lm_loss"] for r in records if "train/lm_loss" in r}


def compare(full_path: str, resumed_path: str) -> int:
    full, resumed = losses(full_path), losses(resumed_path)
    differ = [it for it in resumed if full.get(it) != resumed[it]]
    ok = bool(resumed) and not differ
    print(f"resume {'bit-exact' if ok else 'DIFFERS'}: iterations {sorted(resumed)}, "
          f"differing {differ}; unbroken {[full.get(it) for it in sorted(resumed)]}, "
          f"resumed {[resumed[it] for it in sorted(resumed)]}")
    return 0 if ok else 1


def one_gpu_platform(local_rank: int, force_cpu: bool = False):
    from loco_megatron.platform import gloo_on_one_gpu

    return gloo_on_one_gpu()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        sys.exit(compare(*sys.argv[2:4]))
    import pretrain_gpt
    from loco_megatron.training import trainer

    trainer.detect_platform = one_gpu_platform
    sys.exit(pretrain_gpt.main())
