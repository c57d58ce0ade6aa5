#!/usr/bin/env python3
"""Generate text from a loco-megatron checkpoint (torch_dist, any TP/PP/EP layout) on one process.

    python tools/generate.py --load ckpt/run --prompt "def main():"                  # greedy
    python tools/generate.py --load ckpt/run --prompt "import" --top-p 0.9 --temperature 0.8 --seed 1

The model is megatron's GPTModel built on one CPU rank from the run config stored in the
checkpoint; the tokenizer is the run's (--tokenizer-model overrides it). Generation stops at
the end-of-document token or after --max-new-tokens. Prints the prompt followed by the new
text. Bad input (a missing or half-written checkpoint, a wrong tokenizer) ends with one
line and exit code 2.
"""

import argparse
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from loco_megatron.cli import hf_hub_offline  # noqa: E402
from loco_megatron.config import ConfigError  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", required=True, help="checkpoint root (uses its latest iteration) or an iter_N folder")
    ap.add_argument("--prompt", required=True, help="text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to add (default 64)")
    ap.add_argument("--top-p", type=float, default=None,
                    help="nucleus sampling from the tokens holding this much probability (default: greedy)")
    ap.add_argument("--temperature", type=float, default=1.0, help="with --top-p: logits / T (default 1.0)")
    ap.add_argument("--seed", type=int, default=0, help="with --top-p: the sampling seed (default 0)")
    ap.add_argument("--tokenizer-model", default=None,
                    help="the run's sentencepiece model (default: the one its config names, or the built-in "
                         "corpus's under its --data-cache-path)")
    ap.add_argument("--replica", type=int, default=None,
                    help="of a DiLoCo checkpoint, continue with this replica's local model (default: the agreed one)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # megatron-core warns at import about optional fused kernels
    try:
        from loco_megatron.generation import Sampling, generate, whitespace_note

        sampling = Sampling(args.max_new_tokens, args.top_p, args.temperature, args.seed)
        out = generate(args.load, args.prompt, sampling, args.tokenizer_model, offline=hf_hub_offline(),
                       replica=args.replica)
    except ConfigError as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    print(args.prompt + out.text)
    ending = "end of document" if out.stopped_at_eod else f"--max-new-tokens {args.max_new_tokens}"
    print(f"[{len(out.new_ids)} new tokens, stopped at {ending}{whitespace_note(out.text)}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
