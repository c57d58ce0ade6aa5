"""Test fixture (run under torchrun): a torch_dist checkpoint written the way the trainer's
checkpoint contract says, plus this layout's own forward logits for fixed token ids.

    torchrun --nproc_per_node 2 tests/export_fixture.py OUT_DIR TOKENIZER_MODEL [pretrain flags...]
    torchrun --nproc_per_node 2 tests/export_fixture.py OUT_DIR TOKENIZER_MODEL --load CKPT [flags...]

Writes ``OUT_DIR/ckpt/iter_0000001/`` (``dist_checkpointing.save`` of ``{"model":
chunk0.module.sharded_state_dict(), "config": asdict(config)}`` and the saver's SHA-256 sidecars),
``OUT_DIR/ckpt/latest_checkpointed_iteration.txt`` and, on rank 0, ``OUT_DIR/reference.pt`` with the
token ids and the model's full-vocabulary logits (gathered over TP) in float32.

Weights are the seeded initialisation, then every norm weight is drawn at random: fresh
norms are all ones, which would hide swapped or missing norm mappings. With ``--load CKPT``
(a torch_dist checkpoint, e.g. from ``pretrain_gpt.py --save`` in another layout) the
weights are loaded from it instead and only ``reference.pt`` is written.
"""

import dataclasses
import os
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from loco_megatron.checkpoint import files, torch_dist  # noqa: E402
from loco_megatron.cli import parse_config  # noqa: E402
from loco_megatron.distributed import init_distributed  # noqa: E402
from loco_megatron.model import build_model, padded_vocab_size  # noqa: E402
from loco_megatron.platform import detect_platform, platform_context  # noqa: E402


def main() -> None:
    out, tokenizer_model, flags = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    config = parse_config(flags + ["--tokenizer-model", tokenizer_model, "--data-path", "unused"])
    out.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    platform = detect_platform(int(os.environ["LOCAL_RANK"]), force_cpu=True)
    with platform_context(platform):
        init_distributed(config, platform, rank, world)
        from megatron.core import dist_checkpointing
        from megatron.core import parallel_state as ps
        import sentencepiece

        pieces = sentencepiece.SentencePieceProcessor(model_file=tokenizer_model).get_piece_size()
        vocab = padded_vocab_size(pieces, config.parallel.tensor_model_parallel_size)
        chunks = build_model(config, vocab, platform.device)
        if config.checkpoint.load:
            loaded = dist_checkpointing.load({"model": chunks[0].module.sharded_state_dict()}, config.checkpoint.load)
            chunks[0].module.load_state_dict(loaded["model"])
        else:
            gen = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for name, param in chunks[0].module.named_parameters():
                    if "layernorm" in name:
                        param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=gen))
            iteration_dir = out / "ckpt" / "iter_0000001"
            iteration_dir.mkdir(parents=True, exist_ok=True)
            state = {"model": chunks[0].module.sharded_state_dict(), "config": dataclasses.asdict(config)}
            dist_checkpointing.save(state, str(iteration_dir))
            files.write_sidecar(iteration_dir, rank, torch_dist.written_by(iteration_dir, rank))
            if rank == 0:
                (out / "ckpt" / files.LATEST).write_text("1")

        # Fixed ids (the same on every rank: EP/TP ranks see one batch), inside the real vocab.
        tokens = torch.randint(3, pieces, (2, 24), generator=torch.Generator().manual_seed(11))
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        model = chunks[0].module
        model.eval()
        with torch.no_grad():
            logits = model(tokens, position_ids, attention_mask=None)  # [b, s, vocab / TP]
        tp_group = ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, logits.contiguous(), group=tp_group)
        if rank == 0:
            torch.save({"tokens": tokens, "logits": torch.cat(parts, dim=-1)[..., :pieces].float()},
                       out / "reference.pt")
        dist.barrier()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
