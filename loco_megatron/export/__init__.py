"""Export to Hugging Face ``transformers``: LlamaForCausalLM (dense) and MixtralForCausalLM (MoE).

``hf_config`` (what can be expressed, config.json), ``weights`` (megatron -> HF tensor
names and layouts, pure tensor code), ``tokenizer`` (sentencepiece -> tokenizer.json that
encodes identically), ``reader`` (a torch_dist checkpoint of any layout -> one model's
tensors), ``writer`` (the folder, written atomically).
"""

from loco_megatron.export.writer import INSTALL_HINT, ExportSummary, export_to_hf, print_summary

__all__ = ["INSTALL_HINT", "ExportSummary", "export_to_hf", "print_summary"]
