#!/usr/bin/env python3
"""Export a loco-megatron checkpoint (torch_dist, any TP/PP/EP layout) to a Hugging Face folder.

    python tools/export_hf.py --load ckpt/run --out hf/run
    # then: AutoModelForCausalLM.from_pretrained("hf/run"), AutoTokenizer.from_pretrained("hf/run")

Dense models become LlamaForCausalLM, MoE models MixtralForCausalLM. Of a DiLoCo checkpoint
the agreed model is exported (``--replica R``: replica R's own). Bad input (a missing
or half-written checkpoint, an option those classes cannot express, an existing --out)
ends with one line and exit code 2, and nothing is written.
"""

import argparse
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from loco_megatron.cli import hf_hub_offline  # noqa: E402
from loco_megatron.config import ConfigError  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", required=True, help="checkpoint root (uses its latest iteration) or an iter_N folder")
    ap.add_argument("--out", required=True, help="new folder to write (must not exist or be empty)")
    ap.add_argument("--tokenizer-model", default=None,
                    help="the run's sentencepiece model (default: the one its config names, or the built-in "
                         "corpus's under its --data-cache-path); with --tokenizer-type HuggingFaceTokenizer a "
                         "Hugging Face tokenizer folder, tokenizer.json or hub name")
    ap.add_argument("--tokenizer-type", default=None, choices=("SentencePieceTokenizer", "HuggingFaceTokenizer"),
                    help="how to read --tokenizer-model (default: the run's --tokenizer-type)")
    ap.add_argument("--replica", type=int, default=None,
                    help="of a DiLoCo checkpoint, export this replica's local model instead of the agreed one "
                         "(default: the agreed model, after the run's final outer step)")
    args = ap.parse_args()
    # megatron-core warns at import about optional fused kernels; the export uses none of them.
    warnings.simplefilter("ignore")
    try:
        from loco_megatron.export import export_to_hf, print_summary

        summary = export_to_hf(args.load, args.out, args.tokenizer_model, pathlib.Path.home() / ".cache",
                               args.tokenizer_type, hf_hub_offline(), args.replica)
    except ConfigError as e:
        print(f"export_hf.py: error: {e}", file=sys.stderr)
        raise SystemExit(2)
    print_summary(summary)


if __name__ == "__main__":
    main()
