"""tools/export_hf.py: torch_dist checkpoints of parallel layouts -> transformers folders that
compute the framework's logits, with a tokenizer that encodes like the run's sentencepiece model.

The dense checkpoint is written by pretrain_gpt.py --save (PP 2); the MoE one by
tests/export_fixture.py (EP 2, a torchrun script saving by the same checkpoint contract:
dist_checkpointing of {"model": chunk 0's sharded state dict, "config": asdict(config)}
plus the saver's checksums). The fixture also computes the framework's own logits for
fixed ids, in the saving layout (MoE) or in another one (TP 2, for the PP 2 checkpoint).
"""

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch

from conftest import REPO, run_launch

SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "1", "--global-batch-size", "2"]


KNOBS = ["--rotary-base", "500000", "--norm-epsilon", "1e-6", "--use-rope-scaling", "--rope-scaling-factor", "4"]


def _run(cmd: list, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return run_launch(cmd, env, timeout)  # a torchrun on the fork server, anything else as a process


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> pathlib.Path:
    """A small byte-fallback BPE tokenizer trained like the built-in corpus's (400 pieces)."""
    from loco_megatron.data.corpus import stdlib_documents
    from loco_megatron.data.tokenizer import train_sentencepiece

    root = tmp_path_factory.mktemp("export")
    train_sentencepiece(stdlib_documents()[:40], str(root / "tok"), 400)
    return root


def _checkpoint(work: pathlib.Path, name: str, flags: list) -> pathlib.Path:
    out = work / name
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 str(REPO / "tests" / "export_fixture.py"), str(out), str(work / "tok.model"), *SHAPE, *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _export(work: pathlib.Path, load, out, *extra, tokenizer: bool = True) -> subprocess.CompletedProcess:
    tok = ["--tokenizer-model", str(work / "tok.model")] if tokenizer else []
    return _run([sys.executable, "tools/export_hf.py", "--load", str(load), "--out", str(out), *tok, *extra])


def _assert_logits_match(folder: pathlib.Path, reference: pathlib.Path, architecture: str):
    from transformers import AutoModelForCausalLM

    ref = torch.load(reference)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(model).__name__ == architecture
    with torch.no_grad():
        logits = model(ref["tokens"]).logits
    assert logits.shape == ref["logits"].shape  # vocabulary padding stripped
    scale = ref["logits"].abs().max()
    assert (logits - ref["logits"]).abs().max() <= 1e-4 * scale, (logits - ref["logits"]).abs().max()


@pytest.fixture(scope="module")
def dense(work) -> pathlib.Path:
    """pretrain_gpt.py --save at PP 2 (GQA: 4 heads, 2 query groups; untied embeddings; 2 steps
    at lr 0.05, so norms are no longer all ones), the framework's logits of the saved weights
    computed at TP 2 (tests/export_fixture.py --load), exported from the SAVE root."""
    import json

    from loco_megatron.data.corpus import stdlib_documents

    docs = work / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": d}) for d in stdlib_documents()[:40]))
    proc = _run([sys.executable, "tools/preprocess_data.py", "--input", str(docs), "--tokenizer-model",
                 str(work / "tok.model"), "--output-prefix", str(work / "ds")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # GQA, and RoPE/norm settings other than megatron's defaults (theta 10000, eps 1e-5, no scaling).
    gqa = ["--num-query-groups", "2", *KNOBS]
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "pretrain_gpt.py",
                 *SHAPE, *gqa, "--pipeline-model-parallel-size", "2", "--train-iters", "2", "--lr", "0.05",
                 "--lr-warmup-iters", "0", "--eval-interval", "0", "--data-path", str(work / "ds"),
                 "--tokenizer-model", str(work / "tok.model"), "--save", str(work / "dense" / "ckpt")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    _checkpoint(work, "dense", [*gqa, "--tensor-model-parallel-size", "2",
                                "--load", str(work / "dense" / "ckpt" / "iter_0000002")])
    proc = _export(work, work / "dense" / "ckpt", work / "dense_hf", tokenizer=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("exported ") and "saved as TP 1 x PP 2 x EP 1" in proc.stdout
    return work / "dense"


def test_trainer_pp2_checkpoint_exports_to_llama_with_the_tp2_logits(work, dense):
    """Guards against a wrong split of megatron's fused per-query-group linear_qkv into q/k/v
    (GQA heads paired with the wrong k/v), gate/up swapped in SwiGLU's fc1, norms mapped to
    the wrong layer or slot, the stages of a PP 2 checkpoint written by the trainer not
    reassembled (or a layer numbering that differs from the TP 2 model computing the
    reference), vocabulary padding left in the embedding, the run's tokenizer (named in the
    saved config) not found without --tokenizer-model, or a config.json (RoPE theta, eps,
    head counts) that computes something else: the run's --rotary-base 500000, --norm-epsilon
    1e-6 and LLaMA-3 RoPE scaling must reach config.json (10000 / 1e-5 / none were written
    whatever the run used)."""
    import json

    hf = json.loads((work / "dense_hf" / "config.json").read_text())
    assert (hf["architectures"], hf["num_key_value_heads"], hf["tie_word_embeddings"]) == (
        ["LlamaForCausalLM"], 2, False)
    assert (hf["rope_theta"], hf["rms_norm_eps"]) == (500000.0, 1e-6)
    assert hf["rope_scaling"] == hf["rope_parameters"] == {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    _assert_logits_match(work / "dense_hf", dense / "reference.pt", "LlamaForCausalLM")


def test_exported_tokenizer_encodes_like_sentencepiece(work, dense):
    """Guards against the exported tokenizer giving other ids than the sentencepiece model the
    run trained with: transformers' own LlamaTokenizer conversion merges whitespace runs
    (indentation) differently for about 29% of source-code chunks, treats a leading
    space differently, and reads '<s>' in text as the control token; also guards against
    a <s> prepended that training never saw, and a decode that does not give the text back."""
    import sentencepiece
    from transformers import AutoTokenizer

    sp = sentencepiece.SentencePieceProcessor(model_file=str(work / "tok.model"))
    tok = AutoTokenizer.from_pretrained(work / "dense_hf")
    texts = [" leading space", "  two", "x\n\tif a:\n        return  b  ", "héllo 世界 🙂\x00", "<s> a </s>", ""]
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[30:70]:
        src = path.read_text(encoding="utf-8", errors="replace")
        texts += [src[i:i + 2000] for i in range(0, min(len(src), 20000), 2000)]
    for text in texts:
        ids = sp.encode(text)
        assert tok(text)["input_ids"] == ids, text[:60]
        assert tok.decode(ids) == sp.decode(ids), text[:60]


@pytest.fixture(scope="module")
def moe(work) -> pathlib.Path:
    """An EP 2 MoE checkpoint (tied embeddings) and its saving layout's logits (tests/export_fixture.py)."""
    return _checkpoint(work, "moe", ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96",
                                     "--expert-model-parallel-size", "2", "--no-untie-embeddings-and-output-weights"])


def test_moe_ep2_checkpoint_exports_to_mixtral_with_the_same_logits(work, moe):
    """Guards against experts of an EP 2 checkpoint not reassembled or renumbered, the router
    mapped to the wrong tensor, a routing normalisation that differs from megatron's
    (top-k of the logits then softmax over those k = Mixtral's softmax, top-k, renormalise),
    gate/up of each expert swapped, and tied embeddings exported as an output layer."""
    ckpt = moe
    proc = _export(work, ckpt / "ckpt" / "iter_0000001", work / "moe_hf")  # an iter_N folder, not the root
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saved as TP 1 x PP 1 x EP 2" in proc.stdout
    _assert_logits_match(work / "moe_hf", ckpt / "reference.pt", "MixtralForCausalLM")


def _assert_one_line_error(proc, *words):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("export_hf.py: error: "), proc.stderr[-2000:]
    for w in words:
        assert w in lines[0], lines[0]


def test_bad_input_gives_one_line_exit_2_and_writes_nothing(work, dense, tmp_path):
    """Guards against tracebacks or partial folders for: an option LLaMA cannot express
    (learned absolute positions would export silently wrong), a missing --load, a
    half-written checkpoint (no metadata), the per-rank torch format (cannot be resharded),
    Megatron-FSDP's fsdp_dtensor format (other keys: would fail deep inside the reader),
    a shard with a flipped byte (would export wrong weights), the wrong tokenizer, and an
    existing --out (overwritten)."""
    import json

    from megatron.core import dist_checkpointing

    from loco_megatron.checkpoint import files

    ckpt = dense / "ckpt" / "iter_0000002"
    out = tmp_path / "hf"

    learned = tmp_path / "learned"
    shutil.copytree(ckpt, learned)
    common = dist_checkpointing.load_common_state_dict(str(learned))
    common["config"]["model"]["position_embedding_type"] = "learned_absolute"
    common["config"]["model"]["use_rope_scaling"] = False  # (the fixture's RoPE scaling needs RoPE)
    torch.save(common, learned / "common.pt")
    sidecar = learned / files.SIDECAR.format(rank=0)  # a consistent checkpoint of another model
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "common.pt": files.sha256(learned / "common.pt")}))
    _assert_one_line_error(_export(work, learned, out), "--position-embedding-type learned_absolute")

    _assert_one_line_error(_export(work, tmp_path / "nowhere", out), "--load", "does not exist")

    half = tmp_path / "half"
    shutil.copytree(ckpt, half)
    (half / "metadata.json").unlink()
    _assert_one_line_error(_export(work, half, out), "metadata.json")

    per_rank = tmp_path / "torch_format" / "iter_0000003"
    per_rank.mkdir(parents=True)
    (per_rank / "rank_00000.pt").write_bytes(b"x")
    (per_rank.parent / "latest_checkpointed_iteration.txt").write_text("3")
    _assert_one_line_error(_export(work, per_rank.parent, out), "--ckpt-format torch_dist")

    fsdp = tmp_path / "fsdp_dtensor"  # Megatron-FSDP's format: DTensor keys the export does not map
    shutil.copytree(ckpt, fsdp)
    meta = json.loads((fsdp / "metadata.json").read_text())
    (fsdp / "metadata.json").write_text(json.dumps({**meta, "sharded_backend": "fsdp_dtensor"}))
    _assert_one_line_error(_export(work, fsdp, out), "--ckpt-format fsdp_dtensor")

    flipped = tmp_path / "flipped"
    shutil.copytree(ckpt, flipped)
    shard = next(flipped.glob("__1_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # still unpickles: only the saver's checksums catch it
    shard.write_bytes(bytes(data))
    _assert_one_line_error(_export(work, flipped, out), str(shard), "SHA-256")

    from loco_megatron.data.corpus import stdlib_documents
    from loco_megatron.data.tokenizer import train_sentencepiece

    other = train_sentencepiece(stdlib_documents()[:40], str(tmp_path / "other"), 600)
    _assert_one_line_error(_export(work, ckpt, out, "--tokenizer-model", other), "--tokenizer-model", "600 pieces")
    assert not out.exists() and not list(tmp_path.glob(".hf.tmp*"))

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _assert_one_line_error(_export(work, ckpt, out), "--out", "already exists")
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def test_options_llama_and_mixtral_cannot_express_are_named():
    """Guards against exporting a model transformers would compute differently without a
    word: learned positions, LayerNorm, a GeLU MLP with biases, or megatron's pre-softmax
    routing (softmax over all experts, top-k, no renormalisation: not Mixtral's); and against
    refusing the shipped LLaMA/Mixtral configs."""
    from loco_megatron.cli import parse_config
    from loco_megatron.config import ConfigError
    from loco_megatron.export.hf_config import check_exportable
    from loco_megatron.export.reader import single_rank_config
    from loco_megatron.model import transformer_config

    for name in ("tiny_gpt", "tiny_moe", "llama2_7b", "mixtral_8x7b"):
        config = single_rank_config(parse_config(["--config", str(REPO / "configs" / f"{name}.yaml")]))
        check_exportable(config, transformer_config(config))
    for flags, named in ((["--position-embedding-type", "learned_absolute"], "--position-embedding-type"),
                         (["--normalization", "LayerNorm"], "--normalization LayerNorm"),
                         (["--no-swiglu"], "--no-swiglu")):
        with pytest.raises(ConfigError, match=named):
            check_exportable(parse_config(flags))
    moe = parse_config(["--config", str(REPO / "configs" / "tiny_moe.yaml")])
    tconf = transformer_config(moe)
    tconf.moe_router_pre_softmax = True
    with pytest.raises(ConfigError, match="moe_router_pre_softmax"):
        check_exportable(moe, tconf)


def test_exported_rope_computes_megatrons_frequencies():
    """Guards against a config.json whose RoPE differs from what megatron-core applied in
    training: transformers' frequencies from the exported rope parameters (theta and the
    'llama3' scaling with its low/high frequency factors and original context) must equal
    megatron's RotaryEmbedding.inv_freq exactly, with and without --use-rope-scaling (the
    end-to-end logits test sees only 24 positions, where scaling barely shows)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from loco_megatron.cli import parse_config
    from loco_megatron.export.hf_config import hf_config

    shape = ["--hidden-size", "256", "--num-attention-heads", "2", "--rotary-base", "500000"]
    for scaling in ([], ["--use-rope-scaling", "--rope-scaling-factor", "8"], ["--use-rope-scaling"]):
        config = parse_config(shape + scaling)
        theirs = LlamaRotaryEmbedding(LlamaConfig(**hf_config(config, 4096, "float32", {}))).inv_freq
        ours = RotaryEmbedding(kv_channels=128, rotary_percent=1.0, rotary_base=500000, rope_scaling=bool(scaling),
                               rope_scaling_factor=config.model.rope_scaling_factor, use_cpu_initialization=True)
        assert torch.equal(theirs, ours.inv_freq), scaling


def test_export_takes_special_ids_from_the_tokenizer_and_generate_stops_at_eos(tmp_path):
    """Guards against the export writing bos=1, eos=2 into config.json and
    generation_config.json whatever the tokenizer says: with a sentencepiece model numbering
    pad/unk/bos/eos 0/1/2/3, generate() stopped on <s> (2) and never on </s> (3)."""
    import json

    import sentencepiece as spm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loco_megatron.data.corpus import stdlib_documents

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(stdlib_documents()[:40]), model_prefix=str(tmp_path / "tok0123"), vocab_size=400,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, pad_id=0, unk_id=1, bos_id=2, eos_id=3, minloglevel=2, num_threads=1)
    model_file = tmp_path / "tok0123.model"
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                 str(REPO / "tests" / "export_fixture.py"), str(tmp_path / "ck"), str(model_file), *SHAPE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "hf"
    proc = _run([sys.executable, "tools/export_hf.py", "--load", str(tmp_path / "ck" / "ckpt"), "--out", str(out),
                 "--tokenizer-model", str(model_file)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("config.json", "generation_config.json"):
        ids = json.loads((out / name).read_text())
        assert (ids.get("bos_token_id"), ids.get("eos_token_id"), ids.get("pad_token_id")) == (2, 3, 0), (name, ids)
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert tok.convert_tokens_to_ids(["<s>", "</s>"]) == [2, 3]

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # Make </s> the greedy next token after any prompt: the layers add nothing to the
    # residual, embedding column 0 is a large constant (so is the final norm's output there),
    # and only the </s> row of the output layer reads it.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[3, 0] = 1.0
    prompt = tok("def f(x):", return_tensors="pt")["input_ids"]
    generated = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert generated[0, prompt.shape[1]:].tolist() == [3], generated  # </s>, then it stops


def test_generate_from_any_layout_is_deterministic_and_stops_at_eod(work, dense, moe):
    """Guards against tools/generate.py producing text from a model that is not the saved one
    (one-rank reassembly of a PP 2 trained or an EP 2 MoE checkpoint), greedy decoding that
    varies between calls, sampling that ignores its seed, generation running past the
    end-of-document token, and a bad --load giving a traceback instead of one line."""
    from loco_megatron.export.reader import embedding_rows, loaded_model, read_run_config, single_rank_config
    from loco_megatron.generation import Sampling, generate, generate_ids

    prompt = "def main():"
    proc = _run([sys.executable, "tools/generate.py", "--load", str(dense / "ckpt"), "--prompt", prompt,
                 "--max-new-tokens", "6"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout[:-1]  # print's newline
    assert text.startswith(prompt) and len(text) > len(prompt), text
    again = generate(str(dense / "ckpt"), prompt, Sampling(max_new_tokens=6))
    assert prompt + again.text == text  # greedy: the same text in another process
    assert len(again.new_ids) == 6 or again.stopped_at_eod

    path = moe / "ckpt" / "iter_0000001"
    config = single_rank_config(read_run_config(path))
    rows, ddp_prefix = embedding_rows(path)
    ref = torch.load(moe / "reference.pt")
    vocab = ref["logits"].shape[-1]
    with loaded_model(path, config, rows, ddp_prefix) as (model, _):
        tokens = ref["tokens"]
        with torch.no_grad():
            logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), attention_mask=None)[..., :vocab]
        # The one-rank model computes the EP 2 layout's logits: it is the saved model.
        assert (logits - ref["logits"]).abs().max() <= 1e-4 * ref["logits"].abs().max()
        prompt_ids = tokens[0, :8].tolist()

        def run(eod, **kw):
            return generate_ids(model, prompt_ids, eod, vocab, config.model.seq_length, Sampling(**kw))

        greedy, at_eod = run(eod=-1, max_new_tokens=4)
        assert len(greedy) == 4 and not at_eod
        assert run(eod=-1, max_new_tokens=4) == (greedy, False)
        # The end-of-document id ends generation where the model produces it, and is not returned.
        assert run(eod=greedy[0], max_new_tokens=4) == ([], True)
        second = next((i for i, t in enumerate(greedy) if t != greedy[0]), None)
        if second is not None:
            assert run(eod=greedy[second], max_new_tokens=4) == (greedy[:second], True)
        # A nucleus holding only the top token is greedy; a sample repeats with its seed.
        assert run(eod=-1, max_new_tokens=4, top_p=1e-9) == (greedy, False)
        sampled = run(eod=-1, max_new_tokens=4, top_p=0.9, temperature=1.5, seed=3)
        assert run(eod=-1, max_new_tokens=4, top_p=0.9, temperature=1.5, seed=3) == sampled

    bad = _run([sys.executable, "tools/generate.py", "--load", str(work / "nowhere"), "--prompt", "x"])
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"generate.py: error: --load: {work / 'nowhere'} does not exist"], bad.stderr[-2000:]


def test_whitespace_only_generation_is_named():
    """Guards against tools/generate.py on the README's export example printing only
    whitespace with nothing saying so: a 20-step model's greedy text is 320 spaces, which
    looked like no output at all; its end line now names what the text holds."""
    from loco_megatron.generation import whitespace_note

    assert whitespace_note(" " * 320) == "; the new text is whitespace only: 320 spaces"
    assert whitespace_note("\n \n\t\u00a0") == "; the new text is whitespace only: 1 space, 2 newlines, 1 tab, 1 other"
    assert whitespace_note("  x\n") == "" and whitespace_note("") == ""
